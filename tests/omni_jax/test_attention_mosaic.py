"""The shared attention suite on the Mosaic-GPU backend.

`TestMosaicAttentionInterpreted` runs a representative subset through the
Mosaic-GPU interpreter on any machine (races fail the test);
`TestMosaicAttentionGpu` runs the full suite compiled on an sm90 GPU.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import omni_jax
from pallas_kernels import runtime
from tests.mosaic_interpret import interpreted_mosaic
from tests.omni_jax.attention_suite import CASES, AttentionSuite
from tests.reference import relative_error

# The kernels take bf16/fp16, q tiles of 128 rows, and score_mods without captured arrays.
_CAPTURING = ("alibi_score_mod", "relative_table_score_mod")
GPU_CASES = tuple(case for case in CASES if case.name not in _CAPTURING)
_INTERPRETED = ("causal_ragged", "documents_causal_window", "generic_block_mask",
                "mqa_value_dim", "softcap_sinks")
INTERPRETED_CASES = tuple(case for case in CASES if case.name in _INTERPRETED)


class _MosaicSuite(AttentionSuite):
    implementation = "mosaic"
    mask_block_size = (128, 64)

    # The shared versions use float32 inputs, which the Mosaic kernels decline.
    def test_jit_and_vmap_over_batch_of_masks(self) -> None:
        rng = np.random.default_rng()
        ids = np.sort(rng.integers(0, 3, (2, 1, 64)), axis=-1).astype(np.int32)
        q, k, v = (jnp.asarray(rng.standard_normal((2, 1, 64, 2, 64)), jnp.bfloat16)
                   for _ in range(3))

        def one(q, k, v, ids):
            return omni_jax.attention(q, k, v, q_segment_ids=ids, is_causal=True,
                                      implementation=self.implementation)

        batched = jax.jit(jax.vmap(one))(q, k, v, jnp.asarray(ids))
        for i in range(2):
            expected = one(q[i], k[i], v[i], jnp.asarray(ids[i]))
            assert relative_error(batched[i], expected) < 1e-2

    def test_no_nan_gradient_for_blind_rows(self) -> None:
        rng = np.random.default_rng()
        q, k, v = (jnp.asarray(rng.standard_normal((1, 64, 1, 64)), jnp.bfloat16)
                   for _ in range(3))
        q_ids = jnp.asarray(np.r_[np.zeros(32), np.ones(32)][None].astype(np.int32))
        kv_ids = jnp.zeros((1, 64), jnp.int32)

        def loss(q, k, v):
            out = omni_jax.attention(q, k, v, q_segment_ids=q_ids, kv_segment_ids=kv_ids,
                                     implementation=self.implementation)
            return (out.astype(jnp.float32) ** 2).sum()

        grads = jax.grad(loss, argnums=(0, 1, 2))(q, k, v)
        for grad in grads:
            assert np.isfinite(np.asarray(grad, np.float32)).all()
        assert (np.asarray(grads[0], np.float32)[:, 32:] == 0).all()


class TestMosaicAttentionInterpreted(_MosaicSuite):
    dtypes = ("bfloat16",)
    cases = INTERPRETED_CASES

    @pytest.fixture(autouse=True)
    def _interpreted(self, monkeypatch):
        yield from interpreted_mosaic(monkeypatch)


@pytest.mark.gpu
@pytest.mark.skipif(runtime.interpret_requested() or runtime.gpu_compute_capability() != (9, 0),
                    reason="needs an sm90 GPU (compiled Mosaic-GPU kernels)")
class TestMosaicAttentionGpu(_MosaicSuite):
    dtypes = ("bfloat16", "float16")
    cases = GPU_CASES


def test_score_mod_capturing_arrays_is_declined(monkeypatch):
    monkeypatch.setenv(runtime.INTERPRET_ENV_VAR, "1")
    q = jnp.ones((1, 64, 1, 64), jnp.bfloat16)
    slopes = jnp.ones((1,), jnp.float32)
    with pytest.raises(ValueError, match="captures arrays"):
        omni_jax.attention(q, q, q, score_mod=lambda s, b, h, i, j: s - slopes[h],
                           implementation="mosaic")

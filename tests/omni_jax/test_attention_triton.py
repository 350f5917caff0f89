"""The shared attention suite on the Triton backend.

`TestTritonAttention` runs the kernels in Pallas interpret mode
(`OMNI_JAX_PALLAS_INTERPRET=1`, set per test), so it runs on any machine:
every case in float32, a representative subset in bfloat16 (interpreting
is slow; the GPU class runs every case in every dtype).
`TestTritonAttentionGpu` runs them compiled on sm80+ GPUs; compiled kernels
decline score_mods that capture arrays (they need gathers), so those cases
instead check the decline.
"""

import dataclasses

import jax.numpy as jnp
import pytest

import omni_jax
from pallas_kernels import runtime
from pallas_kernels.triton import configs
from tests.forced_configs import force_config_fields
from tests.omni_jax.attention_suite import CASES, AttentionSuite, Case, check_case

_GATHERING_SCORE_MODS = ("relative_table",)  # captured arrays indexed per score
_ON_GPU = runtime.gpu_compute_capability() is not None


@pytest.fixture
def interpret(monkeypatch):
    monkeypatch.setenv(runtime.INTERPRET_ENV_VAR, "1")


@pytest.mark.interpreted
@pytest.mark.usefixtures("interpret")
class TestTritonAttention(AttentionSuite):
    implementation = "triton"
    dtypes = ("float32",)
    cases = CASES


_BF16_CASES = ("causal_ragged", "generic_block_mask_and_causal", "softcap_sinks")


@pytest.mark.interpreted
@pytest.mark.usefixtures("interpret")
class TestTritonAttentionBfloat16(AttentionSuite):
    implementation = "triton"
    dtypes = ("bfloat16",)
    cases = tuple(c for c in CASES if c.name in _BF16_CASES)

    def test_jit_and_vmap_over_batch_of_masks(self):
        pytest.skip("dtype-independent: runs in TestTritonAttention")

    def test_no_nan_gradient_for_blind_rows(self):
        pytest.skip("dtype-independent: runs in TestTritonAttention")


@pytest.mark.gpu
@pytest.mark.skipif(not _ON_GPU, reason="needs a CUDA GPU")
class TestTritonAttentionGpu(AttentionSuite):
    implementation = "triton"
    dtypes = ("float32", "bfloat16", "float16")
    cases = tuple(c for c in CASES if c.score_mod not in _GATHERING_SCORE_MODS)
    smoke_cases = ("causal_ragged", "generic_block_mask")


@pytest.mark.gpu
@pytest.mark.skipif(not _ON_GPU, reason="needs a CUDA GPU")
def test_compiled_kernels_decline_captured_arrays_indexed_per_score():
    q = jnp.ones((1, 32, 2, 32), jnp.bfloat16)
    table = jnp.linspace(0.0, 1.0, 32)
    with pytest.raises(ValueError, match="gather"):
        omni_jax.attention(q, q, q, score_mod=lambda s, b, h, i, j: s + table[jnp.abs(i - j)],
                           implementation="triton")


@pytest.mark.gpu
@pytest.mark.skipif(not _ON_GPU, reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("head_dim", [192, 256])
@pytest.mark.parametrize("case", [
    Case("causal_ragged", batch=1, q_len=700, kv_len=900, heads=4, kv_heads=2, is_causal=True),
    Case("documents_window", batch=1, q_len=640, kv_len=640, heads=2, kv_heads=1,
         segments="packed", window=(200, 0)),
], ids=lambda case: case.name)
def test_wide_head_dims_compiled(case, head_dim, dtype):
    """The suite runs compiled at head dim 32; this is the 16-bit table row above 128
    (dK and dV in launches of their own) on many tiles with ragged tails."""
    check_case("triton", dataclasses.replace(case, head_dim=head_dim), dtype, (64, 64),
               block_rows=32)


_SPLIT_CASES = ("decode_step_gqa_sinks", "causal_ragged", "generic_block_mask_and_causal")


@pytest.mark.parametrize("compiled", [
    pytest.param(False, marks=pytest.mark.interpreted),
    pytest.param(True, marks=[pytest.mark.gpu,
                              pytest.mark.skipif(not _ON_GPU, reason="needs a CUDA GPU")]),
], ids=["interpreted", "compiled"])
@pytest.mark.parametrize("case", [c for c in CASES if c.name in _SPLIT_CASES],
                         ids=lambda case: case.name)
def test_kv_splits(case, compiled, monkeypatch):
    """Every q tile's walk in three shares, one program each, combined by lse
    (`ForwardConfig.kv_splits`): uneven and empty shares, FULL and masked steps split
    apart, stored tiles, sinks; gradients from the combined output and lse."""
    if not compiled:
        monkeypatch.setenv(runtime.INTERPRET_ENV_VAR, "1")
    force_config_fields(monkeypatch, configs, "forward_config", kv_splits=3)
    check_case("triton", case, "bfloat16" if compiled else "float32", (32, 32))

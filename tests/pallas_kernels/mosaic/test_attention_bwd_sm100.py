"""The Mosaic-GPU sm100 (Blackwell) attention backward against float64.

Run through the Mosaic-GPU interpreter as an sm100 GPU (tcgen05 MMAs and tensor memory,
simulated from jax 0.12; a race found fails the test). The forward's out and lse come
from the float64 reference, so only the backward kernel runs. Poisoned cases fill
memory the kernel never writes with NaN: every gradient row must be written, those of
blocks with nothing to walk included (zeros).
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import omni_jax
from pallas_kernels import compat, runtime
from pallas_kernels.block_sparse import kernel_mask
from pallas_kernels.mosaic import attention_bwd_sm100 as bwd
from tests.jax_releases import skip_unless_blackwell_interpreter
from tests.mosaic_interpret import devices_share_the_interpreter, interpreted_mosaic
from tests.pallas_kernels.mosaic.test_attention_bwd_sm90 import (
    Case,
    _dense_block_mask,
    _score_mod,
    check_kernel_gradients,
)
from tests.reference import relative_error


@pytest.fixture
def _interpreted(monkeypatch):
    skip_unless_blackwell_interpreter()
    yield from interpreted_mosaic(monkeypatch, "sm100")


CASES = (
    # Dense (FULL tiles only), GQA at head dim 128: each CTA sums dK and dV over two
    # query heads' walks, more steps than ring slots.
    Case("dense_gqa_d128", "bfloat16", 1, 256, 256, 4, 2, 128, 128, 128, True, "dense"),
    # Per-head stored tiles under GQA, a q-block that sees nothing and a kv-block nobody
    # sees (dK, dV and dQ rows of zeros).
    Case("partial_gqa_blind_blocks", "bfloat16", 1, 256, 256, 4, 2, 64, 64, 128, True,
         "partial"),
    # Documents (q and kv mask leaves) and causal; ragged q and kv, q_len != kv_len,
    # head dim 96 (run at 128) with a value head dim of 40 (run at 64).
    Case("documents_causal_ragged", "bfloat16", 2, 100, 150, 2, 1, 96, 40, 128, False,
         "documents"),
    # Softcap and score_mod chain rule, fp16, causal (COMPUTED diagonal tiles).
    Case("softcap_score_mod_fp16", "float16", 1, 128, 128, 2, 2, 64, 64, 128, True,
         "causal", softcap=5.0, score_mod=True, scale=0.2),
    # Head dim 256: 32 query rows a step, dK (with dQ) and dV in launches of their own.
    Case("causal_d256", "bfloat16", 1, 256, 256, 2, 1, 256, 256, 128, True, "causal"),
    # DeepSeek's query-key 192 with value 128 under GQA, ragged and causal: dQ^T in a
    # 128-row and a 64-row MMA, split launches (576 TMEM columns together).
    Case("causal_ragged_gqa_d192_v128", "float16", 1, 150, 200, 4, 2, 192, 128, 128, False,
         "causal"),
)


@pytest.mark.interpreted
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_gradients_match_float64(case: Case, _interpreted):
    _check_gradients(case, _score_mod if case.score_mod else None)


@pytest.mark.interpreted
def test_captured_arrays_read_by_element(_interpreted):
    """A score_mod capturing slopes (by head) and a table (by batch and head): the kernel
    reads their elements from the packed smem buffer, derivative included."""
    rng = np.random.default_rng()
    slopes = jnp.asarray(rng.uniform(0.01, 0.1, 4), jnp.float32)
    table = jnp.asarray(rng.standard_normal((2, 4)), jnp.float32)
    case = Case("captured", "bfloat16", 2, 130, 130, 4, 2, 64, 64, 128, False, "causal")
    _check_gradients(case, lambda s, b, h, i, j: s * 0.8 - slopes[h] * (i - j) + table[b, h])


def _check_gradients(case: Case, score_mod):
    from omni_jax.scores import convert_score_mod

    def run(q, k, v, kmask, layout, out, lse, dout, dlse, scale, params):
        config = bwd.backward_config(case.head_dim, case.head_dim_v, case.dtype, causal=False)
        config = dataclasses.replace(config, stages=bwd.MIN_STAGES)
        converted, captured = (None, ()) if score_mod is None else convert_score_mod(score_mod)
        return bwd.attention_backward(
            q, k, v, kmask, layout, out, lse, dout, dlse, scale=scale, softcap=case.softcap,
            score_mod=converted, captured=captured, has_partial=case.mask == "partial",
            config=config, interpret_params=params)[:3]

    check_kernel_gradients(case, score_mod, run)


@pytest.mark.parametrize("head_dim,head_dim_v,mask,variant", [
    (128, 128, "causal", "plain"), (64, 64, "partial", "plain"),
    (256, 256, "partial", "plain"), (192, 128, "partial", "plain"),
    (96, 40, "causal", "plain"),
    # One dQ sum by TMA reduce-adds; softcap with a score_mod (their derivative).
    (128, 128, "causal", "reduce_add"), (64, 64, "partial", "softcap_score_mod")])
def test_lowers_for_cuda(head_dim, head_dim_v, mask, variant):
    """The compiled kernel lowers to Mosaic-GPU on any machine (layouts, swizzles, TMEM,
    the shared-memory limit), at the tuned configs fitted to `SMEM_LIMIT`."""
    skip_unless_blackwell_interpreter()
    seq, heads = 256, 2
    q = jnp.zeros((1, seq, heads, head_dim), jnp.bfloat16)
    k = jnp.zeros((1, seq, 1, head_dim), jnp.bfloat16)
    v = jnp.zeros((1, seq, 1, head_dim_v), jnp.bfloat16)
    out = jnp.zeros((1, seq, heads, head_dim_v), jnp.bfloat16)
    mask_mod = (omni_jax.causal_mask if mask == "causal"
                else lambda b, h, i, j: (i * 7 + j * 3) % 5 != 0)
    kmask, layout = kernel_mask(
        omni_jax.create_block_mask(mask_mod, None, None, seq, seq, (128, 128)))
    dims = bwd.kernel_head_dim(head_dim), bwd.kernel_head_dim(head_dim_v)
    config = bwd.fit_config(bwd.backward_config(head_dim, head_dim_v, jnp.bfloat16, True),
                            bwd.SMEM_LIMIT, *dims, 2, mask == "partial")
    assert config is not None
    config = dataclasses.replace(config, deterministic=variant != "reduce_add")
    scores = {}
    if variant == "softcap_score_mod":
        from omni_jax.scores import convert_score_mod

        scores = dict(softcap=5.0, score_mod=convert_score_mod(_score_mod)[0])

    def grads(q, k, v, out, lse):
        return bwd.attention_backward(q, k, v, kmask, layout, out, lse, out,
                                      jnp.zeros_like(lse), scale=0.1,
                                      **{"softcap": None, "score_mod": None, **scores},
                                      has_partial=mask == "partial", config=config)

    lse = jnp.zeros((1, heads, seq), jnp.float32)
    text = jax.jit(grads).trace(q, k, v, out, lse).lower(lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text


@pytest.mark.parametrize("head_dim", (64, 96, 128, 192, 256))
@pytest.mark.parametrize("head_dim_v", (40, 64, 128, 256))
@pytest.mark.parametrize("has_partial", (False, True))
def test_every_head_dim_pair_has_a_config_that_fits(head_dim, head_dim_v, has_partial):
    """Tensor memory (each launch's accumulators) and shared memory (two ring slots)."""
    config = bwd.backward_config(head_dim, head_dim_v, jnp.bfloat16, causal=False)
    dims = bwd.kernel_head_dim(head_dim), bwd.kernel_head_dim(head_dim_v)
    launches = (("dk",), ("dv",)) if config.split_dkdv else (("dk", "dv"),)
    for names in launches:
        assert bwd.tmem_columns(*dims, config.q_step, names) <= bwd.TMEM_COLUMNS
    assert not config.split_dkdv or bwd.tmem_columns(*dims, config.q_step) > bwd.TMEM_COLUMNS
    assert bwd.fit_config(config, bwd.SMEM_LIMIT, *dims, 2, has_partial) is not None


def test_configs_reject_bad_fields():
    assert bwd.backward_config(320, 128, jnp.bfloat16, causal=False) is None
    with pytest.raises(ValueError, match="block_kv"):
        bwd.BackwardConfig(stages=2, block_kv=64)
    with pytest.raises(ValueError, match="q_step"):
        bwd.BackwardConfig(stages=2, q_step=128)
    with pytest.raises(ValueError, match="stages"):
        bwd.BackwardConfig(stages=1)


@pytest.mark.interpreted
def test_vmap_runs_examples_one_by_one(_interpreted):
    """The in-place dQ sum cannot be batched: under `jax.vmap` each example's gradients
    are those of a call of its own."""
    rng = np.random.default_rng()
    shape = (2, 1, 128, 2, 64)  # [vmapped, batch, seq, heads, head dim]
    q, k, v, dout, out = (jnp.asarray(rng.standard_normal(shape), jnp.bfloat16)
                          for _ in range(5))
    lse = jnp.asarray(rng.standard_normal((2, 1, 2, 128)), jnp.float32) + 5.0
    kmask, layout = kernel_mask(_dense_block_mask(128, 128, (128, 128)))
    config = bwd.BackwardConfig(stages=2)
    params = compat.tma_faithful_interpret_params(runtime.mosaic_interpret_params())

    def backward(q, k, v, out, lse, dout):
        return bwd.attention_backward(q, k, v, kmask, layout, out, lse, dout,
                                      jnp.zeros_like(lse), scale=0.1, softcap=None,
                                      score_mod=None, has_partial=False, config=config,
                                      interpret_params=params)[:3]

    batched = jax.vmap(backward, in_axes=(0, 0, 0, 0, 0, None))(q, k, v, out, lse, dout[0])
    for i in range(2):
        single = backward(q[i], k[i], v[i], out[i], lse[i], dout[0])
        for got, want in zip(batched, single, strict=True):
            assert relative_error(np.asarray(got[i], np.float64),
                                  np.asarray(want, np.float64)) < 1e-2


@pytest.mark.interpreted
@pytest.mark.parametrize("mask", ["dense", "causal"])
def test_gradients_inside_shard_map(mask, monkeypatch, _interpreted):
    """Inside `jax.shard_map` over the batch (two CPU devices) the kernel and its in-place
    dQ sum run per device as outside: gradients of the float64 reference."""
    if len(jax.devices()) < 2:
        pytest.skip("needs 2 devices (tests/conftest.py asks XLA for two host devices)")
    devices_share_the_interpreter(monkeypatch)
    accumulated = []
    accumulating = compat.mosaic_kernel_accumulating
    monkeypatch.setattr(compat, "mosaic_kernel_accumulating", lambda *args, **kwargs: (
        accumulated.append(1) or accumulating(*args, **kwargs)))
    mesh = jax.make_mesh((2,), ("data",), axis_types=(jax.sharding.AxisType.Auto,),
                         devices=jax.devices()[:2])
    case = Case(f"{mask}_shard_map", "bfloat16", 2, 256, 256, 2, 1, 128, 128, 128, True, mask)

    def run(q, k, v, kmask, layout, out, lse, dout, dlse, scale, params):
        def backward(q, k, v, out, lse, dout, dlse):
            return bwd.attention_backward(
                q, k, v, kmask, layout, out, lse, dout, dlse, scale=scale, softcap=None,
                score_mod=None, has_partial=False, config=bwd.BackwardConfig(stages=2),
                interpret_params=params)[:3]

        batch = jax.sharding.PartitionSpec("data")  # the leading axis of every operand
        return jax.jit(jax.shard_map(backward, mesh=mesh, in_specs=(batch,) * 7,
                                     out_specs=(batch,) * 3))(q, k, v, out, lse, dout, dlse)

    check_kernel_gradients(case, None, run)
    assert accumulated

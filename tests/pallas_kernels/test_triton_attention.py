"""Kernel-level tests of the Triton attention kernels (interpreted on CPU).

Interpret mode fills every output with NaN before the kernel runs, so a tile
the kernel forgets to write shows up as NaN: these tests poison for free and
assert no NaN. Shapes exercise tails (lengths not multiples of any tile),
padded head dims (80, 96, different value dim), tiles smaller than the mask
blocks (sub-tiles sharing a block's flags), PARTIAL tiles and rows that see
no key.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import omni_jax
from omni_jax.backends import get_backend
from omni_jax.backends.xla import attention_backward as xla_backward
from omni_jax.backends.xla import attention_forward as xla_forward
from omni_jax.problem import AttentionProblem
from omni_jax.scores import convert_score_mod
from pallas_kernels import compat, runtime
from pallas_kernels.block_sparse import kernel_mask
from pallas_kernels.triton import configs, tiles
from pallas_kernels.triton.attention_bwd import BackwardConfig, attention_backward
from pallas_kernels.triton.attention_fwd import ForwardConfig, attention_forward
from tests.forced_configs import force_config_fields, record_configs
from tests.jax_releases import skip_unless_triton_lowers_here
from tests.omni_jax.attention_suite import Case, check_case
from tests.reference import relative_error


@pytest.fixture(autouse=True)
def interpret(monkeypatch):
    monkeypatch.setenv(runtime.INTERPRET_ENV_VAR, "1")


@pytest.mark.parametrize("case, dtype", [
    (Case("hd80_tails_causal", q_len=45, kv_len=77, head_dim=80, is_causal=True), "float32"),
    (Case("hd96_value_dim40", q_len=100, kv_len=37, head_dim=96, head_dim_v=40), "bfloat16"),
    (Case("short_q_long_kv", batch=1, q_len=16, kv_len=300, heads=2, kv_heads=1,
          window=(50, 20)), "float16"),
], ids=lambda x: getattr(x, "name", x))
@pytest.mark.parametrize("split_dkdv", [False, True], ids=["dkdv", "dk_then_dv"])
def test_tails_and_head_dims_match_reference(case, dtype, split_dkdv, monkeypatch):
    force_config_fields(monkeypatch, configs, "backward_config", split_dkdv=split_dkdv)
    check_case("triton", case, dtype, (32, 32))


def _generic_problem(q_len, kv_len, block, rng, dtype=jnp.float32, mask_mod=None):
    heads, kv_heads, dim = 4, 2, 32
    q = jnp.asarray(rng.standard_normal((2, q_len, heads, dim)), dtype)
    k = jnp.asarray(rng.standard_normal((2, kv_len, kv_heads, dim)), dtype)
    v = jnp.asarray(rng.standard_normal((2, kv_len, kv_heads, dim)), dtype)
    if mask_mod is None:
        mask_mod = lambda b, h, qi, ki: ((qi * 5 + ki * 3 + h) % 7 != 0) & (ki <= qi + 20)
    mask = omni_jax.create_block_mask(mask_mod, None, heads, q_len, kv_len, block)
    problem = AttentionProblem(batch=2, q_len=q_len, kv_len=kv_len, num_q_heads=heads,
                               num_kv_heads=kv_heads, head_dim=dim, head_dim_v=dim,
                               dtype=jnp.dtype(dtype), scale=dim ** -0.5, softcap=None,
                               score_mod=None, has_sinks=False, has_user_mask=True,
                               block_size=block)
    return problem, q, k, v, mask


@pytest.mark.parametrize("split_dkdv", [False, True], ids=["dkdv", "dk_then_dv"])
def test_partial_tiles_split_into_smaller_kernel_tiles(split_dkdv):
    rng = np.random.default_rng()
    problem, q, k, v, block_mask = _generic_problem(70, 90, (32, 64), rng)
    mask, layout = kernel_mask(block_mask)
    kwargs = dict(scale=problem.scale, softcap=None, score_mod=None, interpret=True)
    out, lse = attention_forward(q, k, v, mask, layout, None, (), **kwargs,
                                 config=ForwardConfig(block_q=16, block_kv=16))
    ref_out, ref_lse = xla_forward(problem, q, k, v, block_mask, None, ())
    assert not np.isnan(np.asarray(out)).any() and not np.isnan(np.asarray(lse)).any()
    assert relative_error(out, ref_out) < 1e-5
    assert relative_error(lse, ref_lse) < 1e-5

    dout = jnp.asarray(rng.standard_normal(out.shape), out.dtype)
    dlse = jnp.asarray(rng.standard_normal(lse.shape), jnp.float32)
    grads = attention_backward(q, k, v, mask, layout, (), out, lse, dout, dlse, **kwargs,
                               config=BackwardConfig(16, 32, 32, 16,
                                                     split_dkdv=split_dkdv))[:3]
    ref_grads = xla_backward(problem, q, k, v, block_mask, None, (), ref_out, ref_lse, dout,
                             dlse)[:3]
    for name, grad, ref in zip(("dq", "dk", "dv"), grads, ref_grads, strict=True):
        assert not np.isnan(np.asarray(grad)).any(), name
        assert relative_error(grad, ref) < 1e-5, (name, relative_error(grad, ref))


@pytest.mark.parametrize("block_kv", [32, 16], ids=["tile=block", "two_tiles_per_block"])
def test_forward_counts_through_contiguous_full_blocks(block_kv):
    """A window's FULL blocks start mid-row; walked by counting from the first one
    (`MaskLayout.contiguous_full`) the forward matches the reference, as does the walk
    that reads every index."""
    rng = np.random.default_rng()
    problem, q, k, v, block_mask = _generic_problem(
        200, 200, (32, 32), rng, mask_mod=omni_jax.sliding_window_mask(100, 0))
    mask, layout = kernel_mask(block_mask)
    assert layout.contiguous_full
    ref_out, ref_lse = xla_forward(problem, q, k, v, block_mask, None, ())
    for contiguous in (True, False):
        out, lse = attention_forward(
            q, k, v, mask, dataclasses.replace(layout, contiguous_full=contiguous), None, (),
            scale=problem.scale, softcap=None, score_mod=None, interpret=True,
            config=ForwardConfig(block_q=32, block_kv=block_kv))
        assert not np.isnan(np.asarray(out)).any() and not np.isnan(np.asarray(lse)).any()
        assert relative_error(out, ref_out) < 1e-5, contiguous
        assert relative_error(lse, ref_lse) < 1e-5, contiguous


@pytest.mark.parametrize("splits", [2, 5, 30])
def test_split_walks_combine_to_the_reference(splits):
    """Each q tile's walk in shares (`ForwardConfig.kv_splits`), FULL and masked steps
    split apart, late shares of short walks empty, stored tiles, sinks added once in the
    combine: the result and lse of the unsplit kernel."""
    rng = np.random.default_rng()
    problem, q, k, v, block_mask = _generic_problem(70, 300, (32, 32), rng)
    problem = dataclasses.replace(problem, has_sinks=True)
    sinks = jnp.asarray(rng.standard_normal(problem.num_q_heads), jnp.float32)
    mask, layout = kernel_mask(block_mask)
    out, lse = attention_forward(q, k, v, mask, layout, sinks, (), scale=problem.scale,
                                 softcap=None, score_mod=None, interpret=True,
                                 config=ForwardConfig(block_q=32, block_kv=16, kv_splits=splits))
    ref_out, ref_lse = xla_forward(problem, q, k, v, block_mask, sinks, ())
    assert out.dtype == q.dtype and out.shape == ref_out.shape and lse.shape == ref_lse.shape
    assert not np.isnan(np.asarray(out)).any() and not np.isnan(np.asarray(lse)).any()
    assert relative_error(out, ref_out) < 1e-5
    assert relative_error(lse, ref_lse) < 1e-5


@pytest.mark.parametrize("q_len,kv_len,splits", [(1, 16384, 16), (1, 1024, 1), (512, 4096, 4)])
def test_calls_with_few_q_tiles_split_their_walks(q_len, kv_len, splits, monkeypatch):
    """A decoding step (4 query heads of one kv head packed into 4 rows) over a long
    cache walks in splits, one over a short cache does not, a short prompt with too few q
    tiles to fill the SMs does; a config that fixes ``kv_splits`` keeps it."""
    from omni_jax.backends import triton as backend

    recorded = record_configs(monkeypatch, backend, "attention_forward")
    q = jax.ShapeDtypeStruct((1, q_len, 4, 128), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((1, kv_len, 1, 128), jnp.bfloat16)
    for fixed in (None, 1):
        if fixed is not None:
            force_config_fields(monkeypatch, configs, "forward_config", kv_splits=fixed)
        # A function of its own each time: eval_shape would reuse the first trace.
        jax.eval_shape(lambda q, k, v: omni_jax.attention(q, k, v, implementation="triton"),
                       q, kv, kv)
    assert [c.kv_splits for c in recorded] == [splits, 1]
    assert {c.block_q for c in recorded} == {tiles.MIN_TILE if q_len < 128 else 128}


@pytest.mark.parametrize("head_dim,dtype", [(128, jnp.bfloat16), (64, jnp.float32),
                                            (256, jnp.float16)])
def test_short_query_calls_take_sixteen_row_tiles(head_dim, dtype):
    short = configs.forward_config(head_dim, dtype, q_len=configs.SHORT_Q_LEN - 1)
    assert short.block_q == tiles.MIN_TILE
    long = configs.forward_config(head_dim, dtype, q_len=configs.SHORT_Q_LEN)
    assert long == configs.forward_config(head_dim, dtype)
    assert long.block_q > tiles.MIN_TILE


def test_rows_that_see_nothing_get_zeros_and_minus_inf_lse():
    rng = np.random.default_rng()
    q, k, v = (jnp.asarray(rng.standard_normal((1, 48, 2, 32)), jnp.float32) for _ in range(3))
    q_ids = jnp.asarray(np.r_[np.zeros(20), np.ones(28)][None].astype(np.int32))
    kv_ids = jnp.zeros((1, 48), jnp.int32)

    def run(q, k, v):
        return omni_jax.attention(q, k, v, q_segment_ids=q_ids, kv_segment_ids=kv_ids,
                                  return_lse=True, implementation="triton")

    (out, lse), vjp = jax.vjp(run, q, k, v)
    assert (np.asarray(out)[:, 20:] == 0).all()
    assert np.isneginf(np.asarray(lse)[:, :, 20:]).all()
    assert np.isfinite(np.asarray(lse)[:, :, :20]).all()
    dq, dk, dv = vjp((jnp.ones_like(out), jnp.ones_like(lse)))
    for grad in (dq, dk, dv):
        assert np.isfinite(np.asarray(grad)).all()
    assert (np.asarray(dq)[:, 20:] == 0).all()


def test_declines_what_it_cannot_serve(monkeypatch):
    backend = get_backend("triton")
    problem = AttentionProblem(batch=1, q_len=64, kv_len=64, num_q_heads=2, num_kv_heads=2,
                               head_dim=320, head_dim_v=320, dtype=jnp.dtype(jnp.bfloat16),
                               scale=1.0, softcap=None, score_mod=None, has_sinks=False,
                               has_user_mask=True, block_size=(24, 32))
    assert "head_dim=320" in backend.unsupported_reason(problem)
    problem = AttentionProblem(**{**problem.__dict__, "head_dim": 64, "head_dim_v": 64})
    assert "block_q=24" in backend.unsupported_reason(problem)
    # Compiled, a captured table indexed per score (by q_idx - kv_idx) is a gather, which
    # the Triton lowering lacks.
    monkeypatch.delenv(runtime.INTERPRET_ENV_VAR, raising=False)
    table = jnp.arange(128.0)
    per_score, _ = convert_score_mod(lambda s, b, h, i, j: s + table[jnp.clip(i - j, 0, 127)])
    problem = AttentionProblem(**{**problem.__dict__, "block_size": (64, 64),
                                  "score_mod": per_score})
    if compat.triton_lowerable_primitives() is not None:
        assert "gather" in backend.unsupported_reason(problem)


def test_unavailable_without_gpu_or_interpret(monkeypatch):
    monkeypatch.delenv(runtime.INTERPRET_ENV_VAR)
    reason = get_backend("triton").unavailable_reason()
    if runtime.gpu_compute_capability() is None:
        assert runtime.INTERPRET_ENV_VAR in reason
    else:
        assert reason is None


_SLOPES = 2.0 ** (-8.0 * (jnp.arange(4) + 1) / 4)  # per query head: read as one slice
_LOWERING_FEATURES = {
    "dense_fp32": dict(dtype=jnp.float32),
    "causal_gqa_bf16": dict(dtype=jnp.bfloat16, is_causal=True),
    "ragged_hd80_fp32_window": dict(dtype=jnp.float32, q_len=100, kv_len=77, head_dim=80,
                                    local_window_size=(30, 2)),
    "hd256_fp16_softcap_sinks": dict(dtype=jnp.float16, head_dim=256, softcap=20.0,
                                     sinks=jnp.zeros(4)),
    "documents_score_mod": dict(dtype=jnp.bfloat16, q_segment_ids=jnp.zeros((2, 128), jnp.int32),
                                score_mod=lambda s, b, h, i, j: s - 0.1 * jnp.abs(i - j)),
    "alibi_captured_slopes": dict(dtype=jnp.bfloat16, is_causal=True,
                                  score_mod=lambda s, b, h, i, j: s - _SLOPES[h] * (i - j)),
    # One query of each of 2 sequences x 2 kv heads (packed 2 rows each) over 4096 slots:
    # 4 q tiles walking 32 kv-blocks, in shares (`ForwardConfig.kv_splits`).
    "decode_step_split_walks": dict(dtype=jnp.bfloat16, q_len=1, kv_len=4096),
    "generic_block_mask": dict(dtype=jnp.bfloat16, mask=omni_jax.create_block_mask(
        lambda b, h, i, j: (i + j) % 3 != 0, None, None, 128, 128, 64)),
    "generic_block_mask_and_causal": dict(dtype=jnp.bfloat16, is_causal=True,
                                          mask=omni_jax.create_block_mask(
                                              lambda b, h, i, j: (i + j) % 3 != 0, None, None,
                                              128, 128, 64)),
}


@pytest.mark.parametrize("name", sorted(_LOWERING_FEATURES))
def test_kernels_lower_to_triton(name, monkeypatch):
    """Forward and backward lower through Pallas' Triton lowering (no GPU needed).

    Compiling the Triton IR to PTX still needs the GPU; this catches every
    primitive, shape or indexing the Pallas Triton lowering rejects.
    """
    skip_unless_triton_lowers_here()
    monkeypatch.delenv(runtime.INTERPRET_ENV_VAR)
    monkeypatch.setattr(runtime, "can_run_triton", lambda: True)
    kwargs = dict(_LOWERING_FEATURES[name])
    dtype = kwargs.pop("dtype")
    q_len, kv_len = kwargs.pop("q_len", 128), kwargs.pop("kv_len", 128)
    head_dim = kwargs.pop("head_dim", 64)
    q = jax.ShapeDtypeStruct((2, q_len, 4, head_dim), dtype)
    kv = jax.ShapeDtypeStruct((2, kv_len, 2, head_dim), dtype)

    def forward_backward(q, k, v):
        out, vjp = jax.vjp(lambda q, k, v: omni_jax.attention(
            q, k, v, implementation="triton", **kwargs), q, k, v)
        return vjp(out)

    lowered = jax.jit(forward_backward).trace(q, kv, kv).lower(lowering_platforms=("cuda",))
    assert lowered.as_text().count("xla.gpu.triton") >= 3  # forward, dK/dV, dQ


def test_split_dkdv_lowers_to_triton(monkeypatch):
    """dK and dV in launches of their own (the sm90 head-dim-256 row) lower too."""
    skip_unless_triton_lowers_here()
    monkeypatch.delenv(runtime.INTERPRET_ENV_VAR)
    monkeypatch.setattr(runtime, "can_run_triton", lambda: True)
    force_config_fields(monkeypatch, configs, "backward_config", split_dkdv=True)
    q = jax.ShapeDtypeStruct((1, 128, 4, 256), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((1, 128, 2, 256), jnp.bfloat16)

    def forward_backward(q, k, v):
        out, vjp = jax.vjp(lambda q, k, v: omni_jax.attention(
            q, k, v, is_causal=True, implementation="triton"), q, k, v)
        return vjp(out)

    lowered = jax.jit(forward_backward).trace(q, kv, kv).lower(lowering_platforms=("cuda",))
    assert lowered.as_text().count("xla.gpu.triton") >= 4  # forward, dK, dV, dQ


def test_autotune_caches_the_fastest_config_that_runs():
    import time

    from pallas_kernels.triton import configs

    candidates = [ForwardConfig(block_q=16), ForwardConfig(block_q=32), ForwardConfig(block_q=64)]

    def build(config):
        if config.block_q == 64:
            raise RuntimeError("out of shared memory")
        delay = 0.002 if config.block_q == 32 else 0.02
        return lambda: (time.sleep(delay), jnp.zeros(()))[1]

    key = ("test", 1)
    assert configs.autotune("forward", key, candidates, build, samples=2) == candidates[1]
    assert configs.forward_config(64, jnp.bfloat16, key) == candidates[1]


def test_autotuned_configs_serve_later_calls(monkeypatch):
    from omni_jax.backends import triton as triton_backend
    from pallas_kernels.triton import configs

    rng = np.random.default_rng()
    q, k, v = (jnp.asarray(rng.standard_normal((1, 64, 2, 32)), jnp.float32) for _ in range(3))
    candidates = [ForwardConfig(block_q=16, block_kv=16), ForwardConfig(block_q=32, block_kv=32)]
    forward, backward = triton_backend.autotune(q, k, v, forward_candidates=candidates,
                                                is_causal=True)
    assert forward in candidates and backward is None
    used = []
    lookup = configs.forward_config
    monkeypatch.setattr(configs, "forward_config",
                        lambda *a, **kw: used.append(lookup(*a, **kw)) or used[-1])
    out = omni_jax.attention(q, k, v, is_causal=True, implementation="triton")
    expected = omni_jax.attention(q, k, v, is_causal=True, implementation="xla")
    assert used and all(config == forward for config in used)
    assert relative_error(out, expected) < 1e-5

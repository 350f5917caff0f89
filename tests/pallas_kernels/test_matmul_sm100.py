"""The Blackwell GEMM kernel: configs, its pipelines interpreted (jax 0.11+, race detection
on), and its lowering for CUDA (the 2-CTA configuration, which the interpreter cannot run,
included). Which kernel "mosaic" resolves to is tested with `omni_jax.matmul`."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import compat, runtime
from pallas_kernels.matmul_common import problem_of
from pallas_kernels.mosaic import matmul_sm90 as sm90
from pallas_kernels.mosaic import matmul_sm100 as sm100
from tests.jax_releases import skip_unless_blackwell_interpreter
from tests.mosaic_interpret import interpreted_mosaic
from tests.omni_jax.matmul_helpers import (
    FP8_TOLERANCE,
    assert_close,
    check_vectors_batched_apart,
    random_operands,
    reference,
)
from tests.pallas_kernels.gemm_lowering import LOWERING_CASES, lower_gemm_for_cuda

BF16, F16, F32 = jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32)
E4M3, E5M2 = jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.float8_e5m2)


def _problem(m, n, k, dtype=BF16, out_dtype=BF16, *, transpose_a=False, transpose_b=False):
    a = jax.ShapeDtypeStruct((k, m) if transpose_a else (m, k), dtype)
    b = jax.ShapeDtypeStruct((n, k) if transpose_b else (k, n), dtype)
    return problem_of(a, b, None, None, transpose_a=transpose_a, transpose_b=transpose_b,
                      activation=None, out_dtype=out_dtype)


# ---------------------------------------------------------------------- configs (any jax)

@pytest.mark.parametrize("in_dtype", [BF16, F16, E4M3])
@pytest.mark.parametrize("out_dtype", [BF16, F32])
@pytest.mark.parametrize("vectors", [0, 2])
def test_default_configs_are_valid(in_dtype, out_dtype, vectors):
    problem = _problem(8192, 8192, 8192, in_dtype, out_dtype, transpose_b=True)
    config = sm100.default_config(8192, 8192, 8192, in_dtype, out_dtype, vectors=vectors)
    config.check(problem)
    assert (config.tile_m, config.tile_n) == (128, 256) and config.stages >= 4
    dataclasses.replace(config, collective=True).check(problem)


@pytest.mark.parametrize("m,n,tile_n", [
    (8192, 8192, 256), (4096, 8192, 256),
    # 148 SMs: 128 tiles of 128x256 fill 86 %, 256 of 128x128 86 % (x 0.75)
    (1024, 4096, 256),
    # 64 tiles of 128x256 fill 43 %; 128 of 128x128 86 % (x 0.75)
    (1024, 2048, 128),
    (640, 256, 128),
])
def test_default_tile_width_fills_the_last_wave(m, n, tile_n):
    assert sm100.default_config(m, n, 4096, BF16, BF16).tile_n == tile_n


@pytest.mark.parametrize("change,message", [
    (dict(tile_m=64), "tile_m must be 128"),
    (dict(tile_n=264), "tile_n a multiple of 16"),
    (dict(tile_n=40), "tile_n a multiple of 16"),
    (dict(tile_n=48, collective=True, epilogue_tile_n=16), "tile_n a multiple of 32"),
    (dict(tile_k=32), "one 128-byte swizzle row"),
    (dict(tile_n=128, epilogue_tile_n=48), "epilogue_tile_n must divide tile_n"),
    (dict(stages=1), "stages must be at least 2"),
    (dict(stages=5), "shared memory"),
    # a read as (K, M) needs 128-byte rows in the staged (tile_k, tile_m) block: fine;
    # b read as (K, N) with 2-CTA halves of 32 columns (64 bytes) is not.
    (dict(tile_n=64, epilogue_tile_n=64, collective=True), "tile_n per CTA must span"),
])
def test_bad_configs_are_refused(change, message):
    problem = _problem(512, 512, 512)
    with pytest.raises(ValueError, match=message):
        dataclasses.replace(sm100.MatmulConfig(), **change).check(problem)


def test_unsupported_sizes_are_those_of_the_tma_staging():
    """The same limits as Hopper's kernel: 128-byte rows everywhere, 8-row multiples for a
    read as (K, M) and b read as (K, N)."""
    cases = [_problem(200, 192, 64), _problem(200, 136, 64), _problem(64, 64, 72),
             _problem(200, 64, 64, transpose_a=True), _problem(3, 64, 64, E4M3, F32),
             _problem(64, 64, 64, jnp.dtype(jnp.float32), F32)]
    for problem in cases:
        assert sm100.unsupported_reason(problem) == sm90.unsupported_reason(problem)
    assert sm100.unsupported_reason(cases[0]) is None
    assert "b (stored as (64, 136))" in sm100.unsupported_reason(cases[1])
    assert "input dtype float32" in sm100.unsupported_reason(cases[-1])


def test_ring_position_counts_slots_and_laps():
    counts = jnp.arange(11)
    position = sm100.RingPosition.of(counts, 4)
    np.testing.assert_array_equal(position.slot, np.arange(11) % 4)
    np.testing.assert_array_equal(position.lap, np.arange(11) // 4)


# -------------------------------------------------- interpreted (jax 0.11+, races detected)

@pytest.fixture
def interpreted_sm100(monkeypatch):
    skip_unless_blackwell_interpreter()
    yield from interpreted_mosaic(monkeypatch, "sm100")
    runtime.reset_mosaic_interpreter()


# (m, n, k, dtype, out_dtype, transpose_a, transpose_b, activation, tile_n): M and N tails
# (200 rows, 192 columns of 128-column tiles), each operand layout, each input dtype.
INTERPRETED_CASES = [
    (256, 256, 128, BF16, BF16, False, False, None, 256),
    (200, 192, 192, BF16, F32, False, False, "gelu", 128),
    (200, 192, 128, BF16, BF16, False, True, "silu", 128),
    (192, 128, 64, F16, F16, True, False, None, 128),
    (128, 192, 128, F16, F32, True, True, "relu", 128),
    (200, 256, 256, E4M3, BF16, False, True, None, 128),
    (136, 192, 128, E5M2, F32, True, False, "gelu_tanh", 128),
]


@pytest.mark.interpreted
@pytest.mark.parametrize(
    "m,n,k,dtype,out_dtype,transpose_a,transpose_b,activation,tile_n", INTERPRETED_CASES,
    ids=lambda v: getattr(v, "name", str(v)))
def test_interpreted_against_float64(m, n, k, dtype, out_dtype, transpose_a, transpose_b,
                                     activation, tile_n, interpreted_sm100):
    a, b, bias, seed = random_operands(m, n, k, dtype, transpose_a=transpose_a,
                                       transpose_b=transpose_b, batch=(1,))
    scale = jax.random.uniform(jax.random.key(seed + 1), (1, n), jnp.float32, 0.5, 2.0)
    config = dataclasses.replace(sm100.default_config(m, n, k, dtype, out_dtype, vectors=2),
                                 tile_n=tile_n, stages=3)
    out = sm100.matmul(a, b, scale, bias[None], transpose_a=transpose_a,
                       transpose_b=transpose_b, activation=activation, out_dtype=out_dtype,
                       config=config)
    assert out.dtype == out_dtype
    expected, product = (
        reference(a, b, bias=bias, activation=act, transpose_a=transpose_a,
                  transpose_b=transpose_b, scale=np.asarray(scale, np.float64))
        for act in (activation, None))
    tolerance = FP8_TOLERANCE if dtype.itemsize == 1 and out_dtype == F32 else None
    assert_close(out, expected, out_dtype, seed, tolerance, magnitude=product)


@pytest.mark.interpreted
@pytest.mark.parametrize("transpose_a,transpose_b", [(False, False), (True, True)])
def test_shallow_ring_wraps_across_tiles(transpose_a, transpose_b, interpreted_sm100):
    """2 operand stages, 5 K steps per tile, 3 tiles per persistent CTA: every stage's
    barriers flip phase mid-tile, the TMA warp runs into the next tile's K loop, both
    TMEM accumulators are reused (the MMAs of tile t + 2 wait for tile t's epilogue),
    and the output staging alternates across tiles."""
    m, n, k = 384, 256, 320
    config = sm100.MatmulConfig(tile_n=128, stages=2, epilogue_tile_n=32, group_m=2,
                                num_programs=2)
    a, b, bias, seed = random_operands(m, n, k, BF16, transpose_a=transpose_a,
                                       transpose_b=transpose_b, batch=(1,))
    out = sm100.matmul(a, b, None, bias[None], transpose_a=transpose_a,
                       transpose_b=transpose_b, out_dtype=F32, config=config)
    expected = reference(a, b, bias=bias, transpose_a=transpose_a, transpose_b=transpose_b)
    assert_close(out, expected, F32, seed)
    # The interpreter hands the kernel a zeroed output (the zeros TMA's out-of-bounds reads
    # need); a float32 sum of random products is never exactly 0, so a 0 is unwritten.
    assert np.all(np.asarray(out) != 0), "an output element was never written"


@pytest.mark.interpreted
@pytest.mark.parametrize("batched", ["scale", "bias"])
def test_epilogue_vectors_are_read_at_their_own_batch(batched, interpreted_sm100):
    check_vectors_batched_apart(sm100, batched, 24, 64, 64)


# ---------------------------------------------------- compiled, on a datacenter Blackwell GPU

ON_BLACKWELL = runtime.gpu_compute_capability() is not None and runtime.can_run_mosaic_blackwell()


@pytest.mark.gpu
@pytest.mark.smoke
@pytest.mark.skipif(not ON_BLACKWELL, reason="needs a datacenter Blackwell GPU (sm100)")
@pytest.mark.parametrize("collective", [False, True])
@pytest.mark.parametrize("dtype,transpose_a,transpose_b", [
    (BF16, False, False), (BF16, True, True), (E4M3, False, True)])
def test_gpu_against_float64(collective, dtype, transpose_a, transpose_b):
    """Many tiles per CTA, tails in M and N, both configurations (the 2-CTA one runs
    nowhere else)."""
    m, n, k = 1000, 1088, 1536
    a, b, bias, seed = random_operands(m, n, k, dtype, transpose_a=transpose_a,
                                       transpose_b=transpose_b, batch=(1,))
    out_dtype = BF16
    config = dataclasses.replace(sm100.default_config(m, n, k, dtype, out_dtype, vectors=1),
                                 collective=collective)
    out = sm100.matmul(a, b, None, bias[None], transpose_a=transpose_a,
                       transpose_b=transpose_b, activation="gelu", out_dtype=out_dtype,
                       config=config)
    expected = reference(a, b, bias=bias, activation="gelu", transpose_a=transpose_a,
                         transpose_b=transpose_b)
    assert_close(out, expected, out_dtype, seed)


# ------------------------------------------------------------ lowered for CUDA (any jax)

@pytest.fixture
def _compiling_for_sm100(monkeypatch):
    """Lowering as on a Blackwell GPU: Mosaic stamps sm100 on the module and takes its
    arch-specific paths."""
    monkeypatch.delenv(runtime.INTERPRET_ENV_VAR, raising=False)
    with compat.mosaic_lowering_arch(10, 0):
        yield


@pytest.mark.parametrize("case", LOWERING_CASES, ids=str)
def test_lowers_for_cuda(case, _compiling_for_sm100):
    """What the interpreter cannot check: layout inference (the TMEM loads' layout through
    the epilogue) and the lowering of every op."""
    case = dict(case)
    m = case.pop("m", 1088)
    text = lower_gemm_for_cuda(sm100, m, 1024, 1536, case.pop("dtype", BF16), **case)
    assert "mosaic_gpu" in text


@pytest.mark.parametrize("change", [
    dict(collective=True),
    dict(collective=True, tile_n=128, stages=6),
    dict(tile_n=128, stages=6),
], ids=str)
@pytest.mark.parametrize("case", [
    dict(dtype=BF16), dict(dtype=BF16, transpose_a=True, transpose_b=True),
    dict(dtype=E4M3, transpose_b=True, activation="gelu", out_dtype=BF16),
], ids=str)
def test_configs_lower_for_cuda(change, case, _compiling_for_sm100):
    """The 2-CTA configuration (collective MMAs, partitioned TMA, cluster barriers), which
    the interpreter cannot run, and a narrower single-CTA one lower with both epilogue
    vectors."""
    case = dict(case)
    dtype = case.pop("dtype")
    config = dataclasses.replace(sm100.default_config(
        1088, 1024, 1536, dtype, case.get("out_dtype") or dtype, vectors=2), **change)
    text = lower_gemm_for_cuda(sm100, 1088, 1024, 1536, dtype, config=config, **case)
    assert "mosaic_gpu" in text

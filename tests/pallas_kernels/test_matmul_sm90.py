"""The Hopper GEMM kernel's configs, and its pipeline under configs the defaults never pick.

Interpreted (with race detection) where there is no GPU.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import pytest

from pallas_kernels import runtime
from pallas_kernels.matmul_common import problem_of
from pallas_kernels.mosaic import matmul_sm90 as sm90
from tests.omni_jax.matmul_helpers import (
    assert_close,
    check_vectors_batched_apart,
    random_operands,
    reference,
)
from tests.pallas_kernels.gemm_lowering import LOWERING_CASES, lower_gemm_for_cuda

BF16, F32 = jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32)
ON_GPU = jax.default_backend() == "gpu"


pytestmark = pytest.mark.usefixtures("interpret_pallas_without_gpu")


@pytest.mark.parametrize("in_dtype", [jnp.bfloat16, jnp.float16, jnp.float8_e4m3fn])
@pytest.mark.parametrize("out_dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("m,n,k", [(256, 256, 256), (8192, 8192, 8192), (2048, 16384, 4096),
                                   (16384, 4096, 14336)])
def test_default_configs_are_valid(in_dtype, out_dtype, m, n, k):
    a = jax.ShapeDtypeStruct((m, k), in_dtype)
    b = jax.ShapeDtypeStruct((n, k), in_dtype)
    problem = problem_of(a, b, None, None, transpose_a=False, transpose_b=True,
                         activation=None, out_dtype=out_dtype)
    config = sm90.default_config(m, n, k, in_dtype, out_dtype)
    config.check(problem)
    assert config.stages >= 3


def test_candidates_are_valid():
    a = jax.ShapeDtypeStruct((512, 512), BF16)
    problem = problem_of(a, a, None, None, transpose_a=False, transpose_b=False,
                         activation=None, out_dtype=BF16)
    candidates = sm90.config_candidates(BF16, BF16)
    assert len(candidates) > 10
    for config in candidates:
        config.check(problem)


@pytest.mark.parametrize("change,message", [
    (dict(tile_m=96), "tile_m % 64"),
    (dict(tile_m=128, tile_n=256), "registers per thread"),
    (dict(tile_k=32), "one 128-byte swizzle row"),
    (dict(tile_k=128), "one 128-byte swizzle row"),
    (dict(stages=12), "shared memory"),
])
def test_bad_configs_are_refused(change, message):
    a = jax.ShapeDtypeStruct((512, 512), BF16)
    problem = problem_of(a, a, None, None, transpose_a=False, transpose_b=False,
                         activation=None, out_dtype=BF16)
    with pytest.raises(ValueError, match=message):
        dataclasses.replace(sm90.MatmulConfig(), **change).check(problem)


@pytest.mark.parametrize(
    "m,n,transpose_a,transpose_b,wgmma_in_flight,consumers,pingpong,cluster_n", [
        (136, 192, False, False, 1, 1, False, 1), (192, 192, True, True, 0, 1, False, 1),
        (192, 192, True, False, 1, 2, False, 1), (136, 192, False, True, 1, 2, True, 1),
        (192, 192, True, False, 0, 2, True, 1),
        # 3 N tiles in clusters of 2: the last cluster's second CTA computes past N
        (136, 320, False, False, 1, 2, False, 2), (192, 320, True, True, 1, 2, True, 2),
    ])
def test_shallow_ring_wraps_across_tiles(m, n, transpose_a, transpose_b, wgmma_in_flight,
                                         consumers, pingpong, cluster_n):
    """2 stages, 5 K steps per tile, several tiles per persistent CTA: every slot's
    barriers flip phase many times, also mid-tile, and the epilogue of one tile
    overlaps the next tile's loads (pingpong: the consumers alternate tiles on one
    ring, each with its own barriers, and a tile's step count (5) is not a multiple
    of the ring's; clusters: A multicast to both CTAs, slots freed by both CTAs'
    consumers)."""
    if cluster_n > 1 and not ON_GPU:
        pytest.skip("the Mosaic-GPU interpreter has no cluster barriers")
    k = 320
    config = sm90.MatmulConfig(tile_m=64, tile_n=128, tile_k=64, stages=2,
                               num_consumers=consumers, group_m=2,
                               wgmma_in_flight=wgmma_in_flight, pingpong=pingpong,
                               cluster_n=cluster_n, num_programs=2 * cluster_n)
    a, b, bias, seed = random_operands(m, n, k, BF16, transpose_a=transpose_a,
                                       transpose_b=transpose_b, batch=(1,))
    out = sm90.matmul(a, b, None, bias[None], transpose_a=transpose_a,
                      transpose_b=transpose_b, activation="silu", out_dtype=F32, config=config)
    expected = reference(a, b, bias=bias, activation="silu", transpose_a=transpose_a,
                         transpose_b=transpose_b)
    assert_close(out, expected, F32, seed)


@pytest.mark.parametrize("batched", ["scale", "bias"])
def test_epilogue_vectors_are_read_at_their_own_batch(batched):
    check_vectors_batched_apart(sm90, batched, 24, 64, 64)


@pytest.fixture
def _compiling(monkeypatch):
    monkeypatch.delenv(runtime.INTERPRET_ENV_VAR, raising=False)


@pytest.mark.parametrize("case", LOWERING_CASES, ids=str)
def test_lowers_for_cuda(case, _compiling):
    """What the interpreter cannot check: layout inference and the lowering of every op."""
    case = dict(case)
    m = case.pop("m", 1088)
    text = lower_gemm_for_cuda(sm90, m, 1024, 1536, case.pop("dtype", BF16), **case)
    assert "mosaic_gpu" in text


def _distinct_kernels(configs):
    """One config per kernel variant (tile shape, schedule, cluster, wgmma depth)."""
    seen = {}
    for config in configs:
        key = (config.tile_m, config.tile_n, config.pingpong, config.cluster_n,
               config.wgmma_in_flight)
        seen.setdefault(key, config)
    return list(seen.values())


# (lowered with both epilogue vectors, scale and bias)
@pytest.mark.parametrize("config", _distinct_kernels(sm90.config_candidates(BF16, BF16, 2)),
                         ids=str)
def test_candidate_variants_lower_for_cuda(config, _compiling):
    text = lower_gemm_for_cuda(sm90, 1088, 1024, 1536, BF16, activation="gelu", config=config)
    assert "mosaic_gpu" in text


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")
@pytest.mark.parametrize("config", sm90.config_candidates(BF16, BF16, vectors=1), ids=str)
def test_gpu_every_candidate_is_correct(config):
    """Each autotuning candidate computes the right thing (tails in M, N and K)."""
    m, n, k = 1000, 832, 1088
    a, b, bias, seed = random_operands(m, n, k, BF16, batch=(1,))
    out = sm90.matmul(a, b, None, bias[None], activation="gelu", config=config)
    assert_close(out, reference(a, b, bias=bias, activation="gelu"), BF16, seed)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")
@pytest.mark.parametrize("m", [40, 64, 128])
@pytest.mark.parametrize("tile_n", [64, 128, 256])
def test_gpu_output_narrower_than_the_tile(m, tile_n):
    """An output one epilogue chunk wide (N = 64 in bf16) under wider tiles: the chunks past
    N are not stored. Mosaic took a chunk slice as wide as the output to start at 0, and
    those chunks' zeros overwrote the output (every element was 0 before the fix)."""
    a, b, bias, seed = random_operands(m, 64, 64, BF16, batch=(1,))
    config = sm90.MatmulConfig(tile_m=64, tile_n=tile_n, tile_k=64, stages=2)
    out = sm90.matmul(a, b, None, bias[None], config=config)
    assert_close(out, reference(a, b, bias=bias), BF16, seed)

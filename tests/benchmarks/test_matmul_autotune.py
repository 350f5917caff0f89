"""The Hopper GEMM's autotuner: every correct candidate timed, the winner kept.

Interpreted (with race detection) where there is no GPU.
"""

from __future__ import annotations

import jax.numpy as jnp
import pytest

from benchmarks.matmul_autotune import autotune
from pallas_kernels.matmul_common import problem_of
from pallas_kernels.mosaic import matmul_sm90 as sm90
from tests.omni_jax.matmul_helpers import random_operands

BF16 = jnp.dtype(jnp.bfloat16)

pytestmark = pytest.mark.usefixtures("interpret_pallas_without_gpu")


def test_autotune_times_every_correct_candidate_and_caches_the_winner(monkeypatch):
    monkeypatch.setattr(sm90, "_TUNED", {})
    a, b, _, _ = random_operands(128, 128, 64, BF16)
    candidates = [sm90.MatmulConfig(tile_m=64, tile_n=n, tile_k=64, stages=2) for n in (64, 128)]
    best, timings = autotune(a, b, candidates=candidates, samples=2)
    assert set(timings) == set(candidates) and best == min(timings, key=timings.get)
    problem = problem_of(a, b, None, None, transpose_a=False, transpose_b=False,
                         activation=None, out_dtype=BF16)
    assert sm90._TUNED[sm90.tuning_key(problem)] == best

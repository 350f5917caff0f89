"""Autotuning of the Hopper GEMM: time the candidate configs on the device, keep the best.

It lives with the benchmarks because it times kernels; the kernel module only keeps
the winners (`pallas_kernels.mosaic.matmul_sm90.set_tuned`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp

from benchmarks.timing import bench_interleaved
from omni_jax.matmul import xla
from pallas_kernels.matmul_common import problem_of
from pallas_kernels.mosaic.matmul_sm90 import (
    MatmulConfig,
    config_candidates,
    matmul,
    set_tuned,
)


def autotune(
    a: jax.Array,
    b: jax.Array,
    scale: jax.Array | None = None,
    bias: jax.Array | None = None,
    *,
    candidates: list[MatmulConfig] | None = None,
    samples: int = 10,
    **kwargs,
) -> tuple[MatmulConfig, dict[MatmulConfig, float]]:
    """Times ``candidates`` (default: `config_candidates`) on the device; caches the winner.

    ``kwargs`` are the kernel's keywords. Each candidate's result is first checked
    against XLA's; candidates that fail to build (for example out of shared
    memory on this device) or compute something else are skipped. The others
    take their timing samples in turn, so clock drift favours none of them.
    Returns the fastest config and the median milliseconds of every candidate
    kept. Later calls with the same sizes, layouts and dtypes use the winner.
    """
    out_dtype = jnp.dtype(kwargs.get("out_dtype") or a.dtype)
    if candidates is None:
        vectors = int(scale is not None) + int(bias is not None)
        candidates = config_candidates(a.dtype, out_dtype, vectors)
    expected = xla.matmul(a, b, scale, bias, **{**kwargs, "out_dtype": jnp.float32})
    tolerance = 4 * max(float(jnp.finfo(out_dtype).eps), 1e-3) * float(jnp.linalg.norm(expected))
    correct: dict[MatmulConfig, Callable] = {}
    for config in candidates:
        fn = jax.jit(functools.partial(matmul, config=config, **kwargs))
        try:
            out = fn(a, b, scale, bias).astype(jnp.float32)
        except Exception:  # noqa: BLE001 - a config that does not build is no candidate
            continue
        if float(jnp.linalg.norm(out - expected)) <= tolerance:  # wrong or NaN: never a winner
            correct[config] = fn
    timed = bench_interleaved(correct, [(a, b, scale, bias)], samples=samples)
    timings = {config: ms for config, ms in timed.items() if not isinstance(ms, Exception)}
    if not timings:
        raise ValueError("autotune: no candidate config built and matched XLA for this problem")
    best = min(timings, key=timings.get)
    set_tuned(problem_of(
        a, b, scale, bias,
        transpose_a=kwargs.get("transpose_a", False),
        transpose_b=kwargs.get("transpose_b", False),
        activation=kwargs.get("activation"), out_dtype=out_dtype,
    ), best)
    return best, timings

"""Timing helpers shared by the benchmarks: warm up, block until ready, take the median.

Wall-clock timing around ``block_until_ready`` of a jitted function measures
device time once the launch queue is saturated; each sample runs the function
``inner`` times back to back so launch gaps are amortised. Inputs are rotated
among several copies so repeated runs do not just measure the L2 cache.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax

# Shortest sample worth timing: below this, launch gaps and timer jitter dominate.
MIN_SAMPLE_MS = 2.0


def bench(fn: Callable[..., Any], arg_sets: Sequence[Sequence[Any]], *, warmup: int = 3,
          samples: int = 10, inner: int = 5) -> float:
    """Median milliseconds of one call of ``fn``, cycling through ``arg_sets``.

    ``inner`` is a minimum: short calls run more times per sample, so that a
    sample lasts at least `MIN_SAMPLE_MS`.
    """
    if not arg_sets:
        raise ValueError("bench needs at least one set of arguments")
    for i in range(warmup):
        jax.block_until_ready(fn(*arg_sets[i % len(arg_sets)]))
    start = time.perf_counter()
    for i in range(inner):
        out = fn(*arg_sets[i % len(arg_sets)])
    jax.block_until_ready(out)
    call_ms = (time.perf_counter() - start) * 1e3 / inner
    inner = max(inner, min(200, math.ceil(MIN_SAMPLE_MS / max(call_ms, 1e-3))))
    times = []
    for sample in range(samples):
        start = time.perf_counter()
        out = None
        for i in range(inner):
            out = fn(*arg_sets[(sample * inner + i) % len(arg_sets)])
        jax.block_until_ready(out)
        times.append((time.perf_counter() - start) * 1e3 / inner)
    return statistics.median(times)


def tflops(flops: float, milliseconds: float) -> float:
    """Throughput in TFLOP/s."""
    return flops / (milliseconds * 1e-3) / 1e12

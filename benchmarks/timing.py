"""Timing helpers shared by the benchmarks: warm up, block until ready, take the median.

Wall-clock timing around ``block_until_ready`` of a jitted function measures
device time once the launch queue is saturated; each sample runs the function
``inner`` times back to back so launch gaps are amortised. Inputs are rotated
among several copies so repeated runs do not just measure the L2 cache.

Implementations that are compared are timed together with `bench_interleaved`:
their samples alternate (sample 0 of each, then sample 1 of each, ...) instead of
all samples of one followed by all samples of the next. The GPU's clocks, its
temperature and other load drift over seconds by as much as the differences we
measure (an H100 gave one kernel 0.30x cuBLAS in one run and 1.07x in the next,
timed one after the other); alternating spreads that drift over every
implementation alike, so the medians' ratio keeps only their difference. Each
round also starts at the next implementation, so none always runs first.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import Any, TypeVar

import jax

# Shortest sample worth timing: below this, launch gaps and timer jitter dominate.
MIN_SAMPLE_MS = 2.0
# Most calls per sample, however short the call.
MAX_INNER = 200

Key = TypeVar("Key", bound=Hashable)


def bench(fn: Callable[..., Any], arg_sets: Sequence[Sequence[Any]], *, warmup: int = 3,
          samples: int = 10, inner: int = 5) -> float:
    """Median milliseconds of one call of ``fn``, cycling through ``arg_sets``.

    ``inner`` is a minimum: short calls run more times per sample, so that a
    sample lasts at least `MIN_SAMPLE_MS`. Raises what ``fn`` raises.
    """
    result = bench_interleaved({"fn": fn}, arg_sets, warmup=warmup, samples=samples,
                               inner=inner)["fn"]
    if isinstance(result, Exception):
        raise result
    return result


def bench_interleaved(fns: Mapping[Key, Callable[..., Any]], arg_sets: Sequence[Sequence[Any]],
                      *, warmup: int = 3, samples: int = 10,
                      inner: int = 5) -> dict[Key, float | Exception]:
    """Median milliseconds of one call of each of ``fns``, their samples taken in turn.

    Every function runs on the same ``arg_sets`` and gets its own ``inner`` (at
    least ``inner``, more if a sample would last under `MIN_SAMPLE_MS`). Returns,
    per name in the order of ``fns``, the median or the exception the function
    raised (while warming up or later): the others are still timed.
    """
    if not arg_sets:
        raise ValueError("bench needs at least one set of arguments")
    if samples < 1 or inner < 1:
        raise ValueError(f"samples and inner must be at least 1, got {samples} and {inner}")
    failures: dict[Key, Exception] = {}
    inners: dict[Key, int] = {}
    for name, fn in fns.items():
        try:
            for i in range(warmup):
                jax.block_until_ready(fn(*arg_sets[i % len(arg_sets)]))
            call_ms = _sample_ms(fn, arg_sets, inner, first=0)
        except Exception as error:  # noqa: BLE001 - reported per function
            failures[name] = error
            continue
        inners[name] = max(inner, min(MAX_INNER, math.ceil(MIN_SAMPLE_MS / max(call_ms, 1e-3))))

    times: dict[Key, list[float]] = {name: [] for name in inners}
    for sample in range(samples):
        live = [name for name in inners if name not in failures]
        if not live:
            break
        start = sample % len(live)
        for name in live[start:] + live[:start]:
            try:
                times[name].append(_sample_ms(fns[name], arg_sets, inners[name],
                                              first=sample * inners[name]))
            except Exception as error:  # noqa: BLE001 - reported per function
                failures[name] = error
    return {name: failures[name] if name in failures else statistics.median(times[name])
            for name in fns}


def _sample_ms(fn: Callable[..., Any], arg_sets: Sequence[Sequence[Any]], calls: int, *,
               first: int) -> float:
    """Milliseconds per call of ``calls`` back-to-back calls, from argument set ``first`` on."""
    start = time.perf_counter()
    out = None
    for i in range(calls):
        out = fn(*arg_sets[(first + i) % len(arg_sets)])
    jax.block_until_ready(out)
    return (time.perf_counter() - start) * 1e3 / calls


def tflops(flops: float, milliseconds: float) -> float:
    """Throughput in TFLOP/s."""
    return flops / (milliseconds * 1e-3) / 1e12

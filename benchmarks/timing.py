"""Timing helpers shared by the benchmarks: warm up, block until ready, take the median.

Wall-clock timing around ``block_until_ready`` of a jitted function measures
device time once the launch queue is saturated; each sample runs the function
``inner`` times back to back so launch gaps are amortised. Inputs are rotated
among several copies so repeated runs do not just measure the L2 cache.

A call shorter than `CHAIN_BELOW_MS` (a small GEMM: microseconds of kernel against tens
of microseconds of host dispatch) would time the host: such a function is timed as
`CHAIN_CALLS` calls inside one jitted executable, each on its own parameters so that XLA
keeps them all, which the GPU runs back to back as it would inside a jitted model.

``sustain_s`` makes every sample last that long instead: the GPU then runs at the clock
its power limit allows under continuous load (`benchmarks.gpu_telemetry`), and
``telemetry`` collects the mean SM clock and power of each function's samples.

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

import argparse
import dataclasses
import math
import statistics
import time
from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import Any, TypeVar

import jax

from benchmarks import gpu_telemetry

# Shortest sample worth timing: below this, launch gaps and timer jitter dominate.
MIN_SAMPLE_MS = 2.0
# Most calls per sample, however short the call.
MAX_INNER = 200
# Calls shorter than this are timed CHAIN_CALLS to an executable (see the module docstring).
CHAIN_BELOW_MS = 0.25
CHAIN_CALLS = 16

Key = TypeVar("Key", bound=Hashable)


def add_sustain_argument(parser: argparse.ArgumentParser) -> None:
    """The ``--sustain SECONDS`` option of the benchmark CLIs (see the module docstring)."""
    parser.add_argument("--sustain", type=float, default=0.0, metavar="SECONDS",
                        help="make every sample last this long, so the GPU runs at the clock "
                             "its power limit allows under continuous load, and note each "
                             "implementation's mean SM clock and power (from nvidia-smi)")


def add_impls_argument(parser: argparse.ArgumentParser, *, default: Sequence[str],
                       check: Callable[[str], object], choices: str) -> None:
    """The ``--impls`` option of the benchmark CLIs: names separated by spaces or commas
    (``--impls a b`` and ``--impls a,b`` alike), each checked by ``check`` (which raises
    ValueError naming what it accepts) so that a typo fails before anything is timed."""

    class ImplsAction(argparse.Action):
        def __call__(self, parser, namespace, values, option_string=None):
            names = [name for value in values for name in value.split(",") if name]
            if not names:
                parser.error(f"argument {option_string}: expected at least one name")
            for name in names:
                try:
                    check(name)
                except ValueError as error:
                    parser.error(f"argument {option_string}: {error}")
            setattr(namespace, self.dest, names)

    parser.add_argument("--impls", nargs="+", action=ImplsAction, default=list(default),
                        metavar="IMPL",
                        help=f"implementations to time, separated by spaces or commas: "
                             f"{choices} (default: {' '.join(default)})")


def add_run_arguments(parser: argparse.ArgumentParser, *, impls: Sequence[str],
                      tiny: str, warmup: int = 3, samples: int = 7, inner: int = 5,
                      check: Callable[[str], object] | None = None,
                      choices: str | None = None) -> None:
    """The options every case benchmark shares: ``--impls`` (of ``impls``, or whatever
    ``check`` accepts, ``choices`` saying what), ``--tiny`` (``tiny`` says what it runs),
    ``--warmup``, ``--samples``, ``--inner``, ``--sustain``."""

    def known(impl: str) -> str:
        if impl not in impls:
            raise ValueError(f"unknown implementation {impl!r}; choose from {tuple(impls)}")
        return impl

    add_impls_argument(parser, default=impls, check=check or known,
                       choices=choices or ", ".join(impls))
    parser.add_argument("--tiny", action="store_true", help=f"{tiny} (CPU smoke test)")
    parser.add_argument("--warmup", type=int, default=warmup)
    parser.add_argument("--samples", type=int, default=samples)
    parser.add_argument("--inner", type=int, default=inner)
    add_sustain_argument(parser)


def timing_options(args: argparse.Namespace) -> dict:
    """`bench_interleaved`'s keywords from `add_run_arguments`' options (one quick sample
    under ``--tiny``)."""
    timing = (dict(warmup=1, samples=2, inner=1) if args.tiny else
              dict(warmup=args.warmup, samples=args.samples, inner=args.inner))
    return timing | {"sustain_s": args.sustain}


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
                      *, warmup: int = 3, samples: int = 10, inner: int = 5,
                      sustain_s: float = 0.0,
                      telemetry: dict[Key, str] | None = None) -> dict[Key, float | Exception]:
    """Median milliseconds of one call of each of ``fns``, their samples taken in turn.

    Every function runs on the same ``arg_sets`` and gets its own ``inner`` (at
    least ``inner``, more if a sample would last under `MIN_SAMPLE_MS`, or under
    ``sustain_s`` seconds when that is set). Returns, per name in the order of
    ``fns``, the median or the exception the function raised (while warming up or
    later): the others are still timed. With ``sustain_s``, ``telemetry`` (when given)
    receives each timed function's `gpu_telemetry.summary` (empty without nvidia-smi).
    """
    if not arg_sets:
        raise ValueError("bench needs at least one set of arguments")
    if samples < 1 or inner < 1:
        raise ValueError(f"samples and inner must be at least 1, got {samples} and {inner}")
    if sustain_s < 0:
        raise ValueError(f"sustain_s must be >= 0, got {sustain_s}")
    if sustain_s and telemetry is not None:
        gpu_telemetry.start()
    failures: dict[Key, Exception] = {}
    prepared: dict[Key, _Timed] = {}
    for name, fn in fns.items():
        try:
            prepared[name] = _prepare(fn, arg_sets, warmup=warmup, inner=inner,
                                      sustain_ms=1e3 * sustain_s)
        except Exception as error:  # noqa: BLE001 - reported per function
            failures[name] = error

    times: dict[Key, list[float]] = {name: [] for name in prepared}
    for sample in range(samples):
        live = [name for name in prepared if name not in failures]
        if not live:
            break
        start = sample % len(live)
        for name in live[start:] + live[:start]:
            try:
                times[name].append(prepared[name].sample_ms(sample))
            except Exception as error:  # noqa: BLE001 - reported per function
                failures[name] = error
    if sustain_s and telemetry is not None:
        telemetry.update({name: gpu_telemetry.summary(timed.windows)
                          for name, timed in prepared.items() if name not in failures})
    return {name: failures[name] if name in failures else statistics.median(times[name])
            for name in fns}


@dataclasses.dataclass
class _Timed:
    """How one function is timed: ``fn`` runs ``calls_each`` calls of the timed function,
    and a sample invokes it ``inner`` times, cycling through ``arg_sets``."""

    fn: Callable[..., Any]
    arg_sets: Sequence[Sequence[Any]]
    calls_each: int = 1
    inner: int = 1
    # (start, end) perf_counter times of the samples taken.
    windows: list[tuple[float, float]] = dataclasses.field(default_factory=list)

    def sample_ms(self, sample: int) -> float:
        """Milliseconds per timed call in sample number ``sample``."""
        start = time.perf_counter()
        calls = _sample_ms(self.fn, self.arg_sets, self.inner, first=sample * self.inner)
        self.windows.append((start, time.perf_counter()))
        return calls / self.calls_each


def _prepare(fn: Callable[..., Any], arg_sets: Sequence[Sequence[Any]], *, warmup: int,
             inner: int, sustain_ms: float = 0.0) -> _Timed:
    """Warms ``fn`` up, chains it if a call is short, sizes a sample to `MIN_SAMPLE_MS`
    (at most `MAX_INNER` calls), or to ``sustain_ms`` when that is set."""
    timed = _Timed(fn, arg_sets, inner=inner)
    for i in range(warmup):
        jax.block_until_ready(fn(*arg_sets[i % len(arg_sets)]))
    call_ms = timed.sample_ms(0)
    if call_ms < CHAIN_BELOW_MS:
        timed = _chained(fn, arg_sets)
        for _ in range(warmup):
            jax.block_until_ready(timed.fn(*timed.arg_sets[0]))
        call_ms = timed.sample_ms(0)
    calls = max(inner, math.ceil(max(MIN_SAMPLE_MS, sustain_ms) / max(call_ms, 1e-3)))
    if not sustain_ms:
        calls = min(MAX_INNER, calls)
    timed.inner = max(1, math.ceil(calls / timed.calls_each))
    timed.windows.clear()  # calibration is no sample
    return timed


def _chained(fn: Callable[..., Any], arg_sets: Sequence[Sequence[Any]]) -> _Timed:
    """`CHAIN_CALLS` calls of ``fn`` in one jitted executable, each on its own parameters
    (bound to the argument sets in turn), so that XLA keeps every call."""
    arity = len(arg_sets[0])

    def chain(*flat_args):
        return [fn(*flat_args[i * arity:(i + 1) * arity]) for i in range(CHAIN_CALLS)]

    flat = [x for i in range(CHAIN_CALLS) for x in arg_sets[i % len(arg_sets)]]
    return _Timed(jax.jit(chain), [flat], calls_each=CHAIN_CALLS)


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

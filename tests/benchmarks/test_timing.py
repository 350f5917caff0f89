"""benchmarks.timing: interleaved samples, per-function failures, the single-function bench."""

from __future__ import annotations

import argparse
import itertools
import math
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import pytest

from benchmarks import timing


def _recording(name: str, calls: list[str], fail_after: int | None = None):
    """A plain Python callable that logs its name per call and returns a JAX array."""
    out = jnp.ones(4)

    def fn(x):
        if fail_after is not None and calls.count(name) >= fail_after:
            raise RuntimeError(f"{name} broke")
        calls.append(name)
        return out + x

    return fn


@pytest.fixture(autouse=True)
def _no_chaining(monkeypatch):
    """Every call timed on its own (the call-counting tests below count Python calls);
    the chaining test turns it back on."""
    monkeypatch.setattr(timing, "CHAIN_BELOW_MS", 0.0)


def test_medians_for_good_functions_and_errors_for_failing_ones():
    def broken(x):
        raise RuntimeError("no kernel for this")

    fns = {"double": jax.jit(lambda x: 2 * x), "broken": broken,
           "sine": jax.jit(jnp.sin)}
    arg_sets = [(jax.random.normal(jax.random.key(i), (64,)),) for i in range(2)]
    timed = timing.bench_interleaved(fns, arg_sets, warmup=1, samples=3, inner=1)
    assert list(timed) == list(fns)
    assert isinstance(timed["broken"], RuntimeError)
    assert "no kernel" in str(timed["broken"])
    for name in ("double", "sine"):
        assert isinstance(timed[name], float) and 0 < timed[name] < math.inf


@pytest.mark.parametrize("samples", [1, 4])
def test_samples_alternate_between_functions(monkeypatch, samples):
    monkeypatch.setattr(timing, "MIN_SAMPLE_MS", 0.0)  # every sample: exactly `inner` calls
    calls: list[str] = []
    names = ("a", "b", "c")
    fns = {name: _recording(name, calls) for name in names}
    warmup, inner = 2, 3
    timing.bench_interleaved(fns, [(1.0,)], warmup=warmup, samples=samples, inner=inner)

    setup = len(names) * (warmup + inner)  # warm-up and calibration calls of each
    sampled = calls[setup:]
    assert len(sampled) == samples * len(names) * inner
    blocks = [sampled[i:i + inner] for i in range(0, len(sampled), inner)]
    assert all(len(set(block)) == 1 for block in blocks), "a sample mixes functions"
    order = [block[0] for block in blocks]
    rounds = [order[i:i + len(names)] for i in range(0, len(order), len(names))]
    assert all(sorted(r) == sorted(names) for r in rounds), rounds
    assert len({r[0] for r in rounds}) == min(samples, len(names)), "one always runs first"


def test_a_function_failing_while_sampled_drops_out_alone(monkeypatch):
    monkeypatch.setattr(timing, "MIN_SAMPLE_MS", 0.0)
    calls: list[str] = []
    fns = {"steady": _recording("steady", calls),
           "flaky": _recording("flaky", calls, fail_after=3)}  # warm-up + calibration pass
    timed = timing.bench_interleaved(fns, [(1.0,)], warmup=1, samples=5, inner=1)
    assert isinstance(timed["flaky"], RuntimeError)
    assert isinstance(timed["steady"], float)
    assert calls.count("steady") == 1 + 1 + 5


def test_bench_is_the_single_function_case():
    arg_sets = [(jnp.arange(8.0),)]
    assert timing.bench(jax.jit(jnp.cos), arg_sets, warmup=1, samples=2, inner=1) > 0

    def broken(x):
        raise ValueError("bad shape")

    with pytest.raises(ValueError, match="bad shape"):
        timing.bench(broken, arg_sets)


def test_inner_grows_so_a_sample_lasts_min_sample_ms(monkeypatch):
    clock = itertools.count(step=0.001)  # every perf_counter() reading: +1 ms
    monkeypatch.setattr(timing, "time", SimpleNamespace(perf_counter=lambda: next(clock)))
    monkeypatch.setattr(timing, "MIN_SAMPLE_MS", 5.0)
    calls: list[str] = []
    timing.bench_interleaved({"f": _recording("f", calls)}, [(1.0,)], warmup=0, samples=1,
                             inner=1)
    # Calibration reads the clock twice around one call: 1 ms a call, so 5 calls a sample.
    assert len(calls) == 1 + 5


@pytest.mark.parametrize("kwargs", [dict(samples=0), dict(inner=0)])
def test_rejects_empty_samples(kwargs):
    with pytest.raises(ValueError, match="at least 1"):
        timing.bench_interleaved({"f": jnp.sin}, [(1.0,)], **kwargs)
    with pytest.raises(ValueError, match="one set of arguments"):
        timing.bench_interleaved({"f": jnp.sin}, [])


def test_short_calls_are_chained_in_one_executable_without_merging(monkeypatch):
    monkeypatch.setattr(timing, "CHAIN_BELOW_MS", math.inf)
    fn = jax.jit(lambda x, y: jnp.sin(x) * y)
    arg_sets = [(jax.random.normal(jax.random.key(i), (16,)), jnp.ones(16)) for i in range(2)]
    prepared = timing._prepare(fn, arg_sets, warmup=1, inner=1)
    assert prepared.calls_each == timing.CHAIN_CALLS
    (flat,) = prepared.arg_sets
    assert len(flat) == 2 * timing.CHAIN_CALLS
    outputs = prepared.fn(*flat)
    for i, out in enumerate(outputs):
        x, y = arg_sets[i % 2]
        assert jnp.allclose(out, jnp.sin(x) * y)
    compiled = prepared.fn.lower(*flat).compile().as_text()
    assert compiled.count("sine(") == timing.CHAIN_CALLS, "XLA merged chained calls"

    timed = timing.bench_interleaved({"f": fn}, arg_sets, warmup=1, samples=2, inner=1)
    assert 0 < timed["f"] < math.inf


def test_sustained_samples_last_sustain_s_and_report_telemetry(monkeypatch):
    clock = itertools.count(step=0.001)  # every perf_counter() reading: +1 ms
    monkeypatch.setattr(timing, "time", SimpleNamespace(perf_counter=lambda: next(clock)))
    monkeypatch.setattr(timing.gpu_telemetry, "start", lambda: True)
    # The fake clock moves only when read: a sample spans a few milliseconds of it.
    monkeypatch.setattr(timing.gpu_telemetry, "_readings",
                        [(t / 1000, 1500.0, 690.0, True) for t in range(20)])
    calls: list[str] = []
    telemetry: dict[str, str] = {}
    timing.bench_interleaved({"f": _recording("f", calls)}, [(1.0,)], warmup=0, samples=1,
                             inner=1, sustain_s=0.5, telemetry=telemetry)
    # 1 ms a call: 500 calls a sample, past MAX_INNER (the cap of ordinary samples).
    assert len(calls) == 1 + 500 > timing.MAX_INNER
    assert telemetry == {"f": "SM 1500 MHz, 690 W, power-capped 100%"}


def test_telemetry_stays_empty_without_sustain():
    telemetry: dict[str, str] = {}
    timing.bench_interleaved({"f": jax.jit(jnp.sin)}, [(1.0,)], warmup=1, samples=1, inner=1,
                             telemetry=telemetry)
    assert telemetry == {}
    with pytest.raises(ValueError, match="sustain_s"):
        timing.bench_interleaved({"f": jnp.sin}, [(1.0,)], sustain_s=-1.0)


@pytest.mark.parametrize("argv", [["--impls", "a,b", "c"], ["--impls", "a", "b", "c"],
                                  ["--impls", "a,b,c,"]])
def test_impls_take_spaces_or_commas(argv):
    parser = argparse.ArgumentParser()
    timing.add_impls_argument(parser, default=("a",), check=_known_names, choices="a, b, c")
    assert parser.parse_args(argv).impls == ["a", "b", "c"]
    assert parser.parse_args([]).impls == ["a"]


def test_an_unknown_impl_fails_the_parse_naming_it(capsys):
    parser = argparse.ArgumentParser()
    timing.add_impls_argument(parser, default=("a",), check=_known_names, choices="a, b, c")
    with pytest.raises(SystemExit):
        parser.parse_args(["--impls", "a,cudnn"])
    assert "argument --impls: unknown implementation 'cudnn'" in capsys.readouterr().err


def _known_names(name: str) -> str:
    if name not in ("a", "b", "c"):
        raise ValueError(f"unknown implementation {name!r}")
    return name

"""benchmarks.context runs on CPU at tiny sizes over the test process's two devices
(``--tiny`` is that, with two shapes)."""

from __future__ import annotations

import argparse

import jax
import pytest

from benchmarks import context


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    context.add_arguments(parser)
    return parser.parse_args(list(argv))


def test_tiny_run_checks_then_times_every_strategy():
    if len(jax.devices()) < 2:
        pytest.skip("needs 2 devices")
    rows = context.run(_args("--shapes", "64,4,1,16", "--warmup", "1", "--samples", "2",
                             "--inner", "1", "--devices", "2", "--implementation", "xla",
                             "--impls", "ring", "allgather", "single"))
    assert [row["impl"] for row in rows] == ["ring", "allgather", "single"]
    for row in rows:
        assert row["ms"] > 0 and row["tflops"] > 0 and row["ratio"] > 0
        assert row["case"].startswith("2x64 tokens")


def test_a_wrong_result_is_not_timed(monkeypatch):
    if len(jax.devices()) < 2:
        pytest.skip("needs 2 devices")
    monkeypatch.setattr(context, "zigzag", lambda x, n: x)  # shards in the wrong order
    with pytest.raises(AssertionError, match="differs from the single-device call"):
        context.run(_args("--tiny", "--devices", "2", "--implementation", "xla",
                          "--impls", "ring"))


def test_shapes_are_checked():
    with pytest.raises(ValueError, match="heads a multiple of kv_heads"):
        context.run(_args("--shapes", "64,6,4,16"))

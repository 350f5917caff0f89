"""benchmarks.decode runs on CPU at tiny sizes and follows the benchmark row convention."""

from __future__ import annotations

import argparse

import pytest

from benchmarks import decode


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    decode.add_arguments(parser)
    return parser.parse_args(list(argv))


def test_tiny_run_times_every_impl_of_a_shape_together(timed_together):
    groups = timed_together(decode)
    rows = decode.run(_args("--tiny", "--impls", "omni", "omni_xla", "jax_xla"))
    assert groups == [["omni", "omni_xla", "jax_xla"]] * len(decode.TINY_SHAPES)
    assert len(rows) == 3 * len(decode.TINY_SHAPES)
    for row in rows:
        assert set(row) == {"case", "impl", "ms", "tflops", "ratio", "note"}
        assert row["ms"] > 0 and "GB/s of K/V" in row["note"]
    # Without cuDNN (a CPU), ratios are against jax.nn's XLA.
    assert {row["ratio"] for row in rows if row["impl"] == "jax_xla"} == {1.0}


def test_shapes_are_checked():
    with pytest.raises(ValueError, match="q_heads a multiple of kv_heads"):
        decode.run(_args("--shapes", "1,1,64,6,4,32"))

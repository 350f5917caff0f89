"""benchmarks.paged runs on CPU at tiny sizes, checks before timing, follows the row
convention."""

from __future__ import annotations

import argparse

import numpy as np
import pytest

from benchmarks import paged
from pallas_kernels import runtime


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    paged.add_arguments(parser)
    return parser.parse_args(list(argv))


@pytest.mark.interpreted
def test_tiny_run_checks_and_times_every_impl_of_a_shape_together(timed_together,
                                                                    monkeypatch):
    monkeypatch.setenv(runtime.INTERPRET_ENV_VAR, "1")
    groups = timed_together(paged)
    impls = ("omni", "omni_triton", "omni_xla", "jax_pallas", "fa3", "copy")
    rows = paged.run(_args("--tiny", "--impls", *impls))
    assert len(rows) == len(impls) * len(paged.TINY_SHAPES)
    for row in rows:
        assert set(row) == {"case", "impl", "ms", "tflops", "ratio", "note"}
    by = {(row["case"].split(" page")[0], row["impl"]): row for row in rows}
    decode = "b=2 q=1 kv=200 ragged h=8/2 d=32"
    for impl in ("omni", "omni_triton", "omni_xla"):  # checked, then timed
        assert by[decode, impl]["ms"] > 0 and "GB/s of K/V" in by[decode, impl]["note"]
    # jax 0.12 dropped the GPU paged_attention op: timed where importable, else said so.
    pallas = by[decode, "jax_pallas"]
    assert (pallas["ms"] > 0 and "GB/s of K/V" in pallas["note"]) or (
        np.isnan(pallas["ms"]) and "not importable" in pallas["note"])
    assert by[decode, "omni_xla"]["ratio"] == 1.0  # the baseline without fa3 and cuDNN
    assert "read+written" in by[decode, "copy"]["note"]
    assert np.isnan(by[decode, "fa3"]["ms"]) or by[decode, "fa3"]["ms"] > 0
    # Everything checked and not skipped is timed in one interleaved group per shape.
    assert groups[0] == [impl for impl in impls if not np.isnan(by[decode, impl]["ms"])]


def test_a_wrong_result_is_reported_not_timed(monkeypatch):
    real = paged._function
    monkeypatch.setattr(paged, "_function", lambda impl, args: (
        (lambda *a: real(impl, args)[0](*a) * 1.1, real(impl, args)[1])))
    rows = paged.run(_args("--tiny", "--impls", "omni_xla"))
    assert all(np.isnan(row["ms"]) and "wrong result: relative error" in row["note"]
               for row in rows)


def test_shapes_are_checked():
    with pytest.raises(ValueError, match="uniform\\|ragged"):
        paged.run(_args("--shapes", "1,1,64,8,2,32,16"))
    with pytest.raises(ValueError, match="multiple of kv_heads"):
        paged.run(_args("--shapes", "1,1,64,6,4,32,16,uniform"))


@pytest.mark.interpreted
def test_forced_triton_fields_are_checked_and_timed(monkeypatch):
    monkeypatch.setenv(runtime.INTERPRET_ENV_VAR, "1")
    impl = "omni_triton/block_kv=16/num_warps=2/kv_splits=3"
    rows = paged.run(_args("--tiny", "--shapes", "2,1,200,8,2,32,16,ragged", "--impls", impl,
                           "omni_xla"))
    forced = next(row for row in rows if row["impl"] == impl)
    assert forced["ms"] > 0 and "GB/s of K/V" in forced["note"]


@pytest.mark.parametrize("impl, expected", [
    ("omni_mosaic/block_kv=64/num_stages=4", ("mosaic", {"block_kv": 64, "num_stages": 4})),
    ("omni_triton/kv_splits=8", ("triton", {"kv_splits": 8})),
    ("omni_mosaic", None),
])
def test_forced_fields_are_parsed(impl, expected):
    assert paged.forced_fields(impl) == expected


@pytest.mark.parametrize("impl", ["omni_mosaic/block_q=64x", "omni_triton/stages=2",
                                  "omni_cuda"])
def test_bad_impl_names_fail_before_timing(impl):
    with pytest.raises(SystemExit):
        _args("--impls", impl)

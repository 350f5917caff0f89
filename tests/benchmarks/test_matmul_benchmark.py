"""The matmul benchmark runs end to end with tiny shapes and returns well-formed rows."""

import argparse
import math

import pytest

from benchmarks import matmul
from pallas_kernels import runtime


def test_tiny_run_produces_rows():
    parser = argparse.ArgumentParser()
    matmul.add_arguments(parser)
    rows = matmul.run(parser.parse_args(["--tiny"]))
    assert {row["case"].split()[0] for row in rows} == set(matmul.SUITES)
    for row in rows:
        assert set(row) == {"case", "impl", "ms", "tflops", "ratio", "note"}
        if row["ratio"] is None:
            assert row["note"].startswith(("skipped", "failed")), row
    timed = [row for row in rows if row["impl"] in (matmul.BASELINE, "xla")
             and "geomean" not in row["case"]]
    assert timed and all(row["ms"] > 0 and math.isfinite(row["ratio"]) for row in timed)
    assert not [row for row in rows if row["note"].startswith("failed")]
    assert any("geomean" in row["case"] for row in rows)


def test_a_case_is_timed_together_and_a_failure_is_a_row(monkeypatch, timed_together):
    groups = timed_together(matmul)
    ours = matmul._ours

    def xla_breaks(suite, impl):
        if impl != "xla":
            return ours(suite, impl)

        def broken(*args):
            raise RuntimeError("xla kernel exploded")

        return broken

    monkeypatch.setattr(matmul, "_ours", xla_breaks)
    parser = argparse.ArgumentParser()
    matmul.add_arguments(parser)
    rows = matmul.run(parser.parse_args(["--tiny", "--suites", "sweep",
                                         "--impls", matmul.BASELINE, "xla"]))
    assert groups == [[matmul.BASELINE, "xla"]] * len(matmul.TINY["sweep"])
    cases = [row for row in rows if "geomean" not in row["case"]]
    for row in cases:
        if row["impl"] == "xla":
            assert row["note"].startswith("failed: xla kernel exploded"), row
            assert math.isnan(row["ms"]) and row["ratio"] is None
        if row["impl"] == matmul.BASELINE:
            assert row["ms"] > 0 and row["ratio"] == 1.0


def test_forced_mosaic_impls_change_the_default_config():
    assert matmul._impl_name("mosaic/cluster_n=2/group_m=16") == "mosaic/cluster_n=2/group_m=16"
    args = matmul._inputs("epilogue", 256, 512, 128, seed=0)
    _, note = matmul._forced("mosaic/cluster_n=2/pingpong=1", "epilogue", args)
    assert "cluster_n=2" in note and "pingpong=True" in note
    for bad in ("mosaic/foo=2", "mosaic/stages=x", "cublass"):
        with pytest.raises(ValueError, match="unknown implementation|expected FIELD=N"):
            matmul._impl_name(bad)


def test_forced_mosaic_impls_configure_the_blackwell_kernel_there(monkeypatch):
    monkeypatch.setenv(runtime.INTERPRET_ENV_VAR, "sm100")
    args = matmul._inputs("epilogue", 256, 512, 128, seed=0)
    _, note = matmul._forced("mosaic/collective=1/tile_n=128", "epilogue", args)
    assert "collective=True" in note and "tile_n=128" in note
    with pytest.raises(ValueError, match="expected FIELD=N"):
        matmul._impl_name("mosaic/cluster_n=2")  # a Hopper field

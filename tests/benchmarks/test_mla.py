"""benchmarks.mla runs on CPU at tiny sizes and follows the benchmark row convention."""

from __future__ import annotations

import argparse
import math

from benchmarks import gpu_telemetry, mla


def test_tiny_run_produces_rows_for_every_impl():
    parser = argparse.ArgumentParser()
    mla.add_arguments(parser)
    rows = mla.run(parser.parse_args(["--tiny"]))
    assert [row["impl"] for row in rows] == list(mla.IMPLS)
    for row in rows:
        assert set(row) == {"case", "impl", "ms", "tflops", "ratio", "note"}
        assert isinstance(row["note"], str) and row["note"]
    portable = {row["impl"]: row for row in rows if row["impl"].startswith("portable")}
    for row in portable.values():
        assert row["ms"] > 0 and row["tflops"] > 0
    assert portable[mla.BASELINE]["ratio"] == 1.0
    for row in rows:
        if math.isnan(row["ms"]):
            assert row["ratio"] is None and row["note"].startswith("skipped")


def test_implementations_are_timed_together_and_a_failure_is_a_row(monkeypatch,
                                                                    timed_together):
    groups = timed_together(mla)
    prefill = mla.sparse_mla_prefill

    def scores_break(*args, return_scores, **kwargs):
        if return_scores:
            raise RuntimeError("scores kernel exploded")
        return prefill(*args, return_scores=return_scores, **kwargs)

    monkeypatch.setattr(mla, "sparse_mla_prefill", scores_break)
    parser = argparse.ArgumentParser()
    mla.add_arguments(parser)
    rows = {row["impl"]: row for row in mla.run(parser.parse_args(
        ["--tiny", "--impls", "portable", "portable+scores"]))}
    assert groups == [["portable", "portable+scores"]]
    assert rows["portable"]["ratio"] == 1.0
    failed = rows["portable+scores"]
    assert failed["note"].startswith("failed: RuntimeError: scores kernel exploded"), failed
    assert math.isnan(failed["ms"]) and failed["ratio"] is None


def test_sustained_samples_note_the_clock_and_power(monkeypatch):
    monkeypatch.setattr(gpu_telemetry, "summary",
                        lambda windows: "SM 1500 MHz, 690 W" if windows else "")
    parser = argparse.ArgumentParser()
    mla.add_arguments(parser)
    rows = mla.run(parser.parse_args(["--tiny", "--impls", "portable", "--sustain", "0.01"]))
    assert rows[0]["ms"] > 0
    assert rows[0]["note"].endswith("; SM 1500 MHz, 690 W")

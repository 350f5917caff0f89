"""The Mosaic config sweep runs on a CPU with tiny sizes (peers that cannot run are noted)."""

import argparse

from benchmarks import mosaic_attention_configs
from pallas_kernels import runtime


def test_runs_with_tiny_sizes(monkeypatch):
    monkeypatch.delenv("OMNI_JAX_PALLAS_INTERPRET", raising=False)
    parser = argparse.ArgumentParser()
    mosaic_attention_configs.add_arguments(parser)
    args = parser.parse_args(["--tokens", "128", "--seq", "128", "--heads", "2",
                              "--head-dim", "64", "--causal", "--samples", "2"])
    rows = mosaic_attention_configs.run(args)
    by_impl = {row["impl"]: row for row in rows}
    assert by_impl["xla"]["ms"] > 0 and by_impl["xla"]["note"] == ""
    assert set(rows[0]) == {"case", "impl", "ms", "tflops", "ratio", "note"}
    mosaic = by_impl["mosaic"]
    if runtime.can_run_mosaic_hopper():  # a Hopper GPU times it for real
        assert mosaic["ms"] > 0 and mosaic["note"] == "", mosaic
    else:
        assert mosaic["note"].startswith("skipped"), mosaic

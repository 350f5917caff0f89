"""The attention benchmark runs end to end on tiny CPU shapes (keeps the CLI from rotting)."""

import argparse
import math

import jax

from benchmarks import attention
from pallas_kernels import runtime


def test_tiny_run_produces_rows_for_every_impl(monkeypatch, capsys):
    monkeypatch.setenv(runtime.INTERPRET_ENV_VAR, "1")
    parser = argparse.ArgumentParser()
    attention.add_arguments(parser)
    impls = ["omni_xla", "omni_triton", "cudnn", "jax_pallas_mha"]
    args = parser.parse_args(["--tiny", "--cases", "dense,window b1 s128 h2 d32 fwd+bwd",
                              "--impls", ",".join(impls), "--warmup", "1", "--samples", "1",
                              "--inner", "1"])
    rows = attention.run(args)
    attention.print_table(rows)
    assert "jax " in capsys.readouterr().out
    cases = {row["case"] for row in rows}
    assert len(cases) == 3
    assert len(rows) == len(cases) * len(impls)
    for row in rows:
        assert set(row) == {"case", "impl", "ms", "tflops", "ratio", "note"}
        if row["impl"] in ("omni_xla", "omni_triton"):
            assert math.isfinite(row["ms"]) and row["ms"] > 0, row
        if row["impl"] == "cudnn" and jax.default_backend() != "gpu":
            assert row["note"].startswith("skipped"), row
    window = [r for r in rows if r["case"].startswith("window") and r["impl"] == "omni_xla"]
    assert "active blocks" in window[0]["note"]


def test_cli_help():
    parser = argparse.ArgumentParser()
    attention.add_arguments(parser)
    assert "--tiny" in parser.format_help()

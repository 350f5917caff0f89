"""`python -m benchmarks` on CPU with fake benchmark modules (tiny, no real kernels)."""

from __future__ import annotations

import csv
import json
import subprocess
import sys
import types

import pytest

from benchmarks import __main__ as cli
from benchmarks import report


def fake_attention() -> types.ModuleType:
    module = types.ModuleType("benchmarks.attention")
    module.__doc__ = "fake attention benchmark"
    module.BASELINE = "dense"

    def add_arguments(parser):
        parser.add_argument("--seq", type=int, nargs="+", default=[16, 32])

    def run(args):
        rows = []
        for mask in ("causal", "documents"):
            for seq in args.seq:
                ms = {"dense": 2.0, "xla": 1.0}
                rows += [{"case": f"{mask} b=1 h=2 seq={seq} d=8", "impl": impl, "ms": t,
                          "tflops": seq / t / 1e3, "ratio": ms["dense"] / t, "note": ""}
                         for impl, t in ms.items()]
        return rows

    module.add_arguments, module.run = add_arguments, run
    return module


def fake_matmul() -> types.ModuleType:
    module = types.ModuleType("benchmarks.matmul")
    module.add_arguments = lambda parser: None
    module.run = lambda args: [
        {"case": f"bf16 m={s} n={s} k={s}", "impl": impl, "ms": 1.0, "tflops": s / 100,
         "ratio": None, "note": "skipped peer" if impl == "cublas" else ""}
        for s in (64, 128, 256) for impl in ("xla", "cublas")]
    return module


def broken() -> types.ModuleType:
    module = types.ModuleType("benchmarks.mla")
    module.add_arguments = lambda parser: None

    def run(args):
        raise RuntimeError("kernel exploded")

    module.run = run
    return module


@pytest.fixture
def modules(monkeypatch):
    """The benchmark modules the CLI sees (missing names: not available)."""
    available = {}
    monkeypatch.setattr(cli, "load", available.get)
    return available


def test_one_benchmark_writes_table_files_plot_and_markdown(modules, tmp_path, capsys):
    modules["attention"] = fake_attention()
    assert cli.main(["attention", "--seq", "16", "64", "--out-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "jax " in out and "jaxlib " in out and "device:" in out
    assert "causal b=1 h=2 seq=64 d=8" in out and "TFLOP/s" in out
    with open(tmp_path / "attention.csv") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 8 and {r["impl"] for r in rows} == {"dense", "xla"}
    saved = json.loads((tmp_path / "attention.json").read_text())
    assert saved["meta"]["benchmark"] == "attention" and len(saved["rows"]) == 8
    assert (tmp_path / "attention.png").stat().st_size > 0
    markdown = (tmp_path / "RESULTS-block.md").read_text()
    assert "python -m benchmarks attention --seq 16 64" in markdown
    assert "| causal b=1 h=2 seq=16 d=8 | xla | 1.000 |" in markdown


def test_markdown_prints_the_table_as_markdown(modules, tmp_path, capsys):
    modules["attention"] = fake_attention()
    assert cli.main(["attention", "--seq", "16", "--markdown", "--no-plots",
                     "--out-dir", str(tmp_path)]) == 0
    assert "| causal b=1 h=2 seq=16 d=8 | xla | 1.000 |" in capsys.readouterr().out


def test_all_runs_what_exists_and_reports_the_rest(modules, tmp_path, capsys):
    modules["attention"], modules["matmul"] = fake_attention(), fake_matmul()
    rc = cli.main(["all", "--out-dir", str(tmp_path), "--attention-args", "--seq 8"])
    out = capsys.readouterr().out
    assert rc == 0
    assert "not available" in out and "NOTE mla" in out
    markdown = (tmp_path / "RESULTS-block.md").read_text()
    assert "### attention" in markdown and "### matmul" in markdown
    assert "seq=8" in markdown and "seq=16" not in markdown
    assert (tmp_path / "matmul.png").exists()


def test_all_keeps_going_after_a_failure(modules, tmp_path, capsys):
    modules["attention"], modules["mla"] = fake_attention(), broken()
    assert cli.main(["all", "--out-dir", str(tmp_path), "--no-plots"]) == 1
    assert "kernel exploded" in capsys.readouterr().out
    assert (tmp_path / "attention.csv").exists() and not (tmp_path / "attention.png").exists()


def test_missing_or_unknown_benchmark(modules, capsys):
    assert cli.main(["mla"]) == 2
    assert "not available" in capsys.readouterr().out
    assert cli.main(["nonsense"]) == 2
    assert cli.main([]) == 0


def test_module_help_lists_its_own_arguments(modules, capsys):
    modules["attention"] = fake_attention()
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["attention", "--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert "--seq" in out and "--out-dir" in out


def test_rows_missing_required_fields_are_rejected():
    with pytest.raises(ValueError, match="without"):
        report.check_rows("x", [{"case": "a", "impl": "b"}])


@pytest.mark.parametrize(("case", "seq", "mask"), [
    ("causal b=2 h=16 seq=4096 d=128", 4096, "causal"),
    ("sliding_window s=1024", 1024, "sliding window"),
    ("documents seq_len:512 bf16", 512, "documents bf16"),
])
def test_case_parsing(case, seq, mask):
    row = {"case": case}
    assert report.sequence_length(row) == seq
    assert report.mask_type(row) == mask


def test_gemm_shape_parsing():
    assert report.gemm_shape({"case": "bf16 m=512 n=256 k=128"}) == (512, 256, 128)
    assert report.gemm_shape({"case": "fp8 4096x2048x1024"}) == (4096, 2048, 1024)
    assert report.gemm_shape({"case": "x", "m": 1, "n": 2, "k": 3}) == (1, 2, 3)


def test_python_dash_m_entry_point():
    done = subprocess.run([sys.executable, "-m", "benchmarks", "--help"], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0 and "gpu-suite" in done.stdout


@pytest.mark.parametrize("name", ["attention", "matmul", "mla"])
def test_each_module_runs_as_the_one_command(name):
    """``python -m benchmarks.<name>`` is ``python -m benchmarks <name>``: same options."""
    done = subprocess.run([sys.executable, "-m", f"benchmarks.{name}", "--help"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert f"python -m benchmarks {name}" in done.stdout
    assert "--out-dir" in done.stdout and "--markdown" in done.stdout

"""The quickstart example runs and checks itself against dense attention."""

import importlib.util
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(("implementation", "seq", "env"), [
    ("xla", 256, {}),
    # bfloat16 inputs and 128-blocks, which the Mosaic kernels need (one block: interpreted;
    # without NPROC, which omni_jax sets for the interpreter itself).
    pytest.param("mosaic", 40, {"OMNI_JAX_PALLAS_INTERPRET": "1"},
                 marks=pytest.mark.interpreted),
])
def test_quickstart_runs(implementation, seq, env):
    result = subprocess.run([sys.executable, str(ROOT / "examples" / "quickstart.py"),
                             "--seq", str(seq), "--implementation", implementation],
                            capture_output=True, text=True, cwd=ROOT, timeout=300,
                            env={**{k: v for k, v in os.environ.items() if k != "NPROC"},
                                 **env})
    assert result.returncode == 0, result.stderr[-3000:]
    assert "relative error vs dense attention" in result.stdout


@pytest.mark.parametrize("argv,message", [
    (["--seq", "2"], "argument --seq: must be >= 3"),
    (["--seq", "x"], "argument --seq: invalid int value"),
    (["--implementation", "Triton"], "argument --implementation: invalid choice: 'Triton'"),
])
def test_quickstart_rejects_bad_arguments(argv, message, capsys):
    spec = importlib.util.spec_from_file_location("quickstart", ROOT / "examples" / "quickstart.py")
    quickstart = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(quickstart)
    with pytest.raises(SystemExit) as exit_info:
        quickstart.parse_args(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err

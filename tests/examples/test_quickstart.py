"""The quickstart example runs and checks itself against dense attention."""

import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_quickstart_runs():
    result = subprocess.run([sys.executable, str(ROOT / "examples" / "quickstart.py"),
                             "--seq", "256", "--implementation", "xla"],
                            capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "relative error vs dense attention" in result.stdout

"""The sharding example runs its three ways on two CPU devices and matches one device."""

import pathlib
import re
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_sharding_example_matches_one_device():
    result = subprocess.run([sys.executable, str(ROOT / "examples" / "sharding.py")],
                            capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    errors = dict(re.findall(r"(\w+): gradients within (\S+) of one device", result.stdout))
    assert set(errors) == {"shard_map", "jit", "explicit"}, result.stdout
    assert all(float(e) < 1e-5 for e in errors.values()), errors

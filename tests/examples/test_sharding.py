"""The sharding example runs its three ways and matches one device: the portable path on
two CPU devices everywhere, the kernels on the GPUs of a GPU machine."""

import os
import pathlib
import re
import subprocess
import sys

import jax
import pytest

from pallas_kernels import runtime

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _errors(implementation: str) -> dict[str, float]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        filter(None, (str(ROOT), os.environ.get("PYTHONPATH"))))}
    result = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "sharding.py"), "--implementation",
         implementation], capture_output=True, text=True, cwd=ROOT, env=env, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    errors = dict(re.findall(r"(\w+): gradients within (\S+) of one device", result.stdout))
    assert set(errors) == {"shard_map", "jit", "explicit"}, result.stdout
    return {name: float(error) for name, error in errors.items()}


def test_sharding_example_matches_one_device():
    errors = _errors("xla")
    assert all(e < 1e-5 for e in errors.values()), errors


@pytest.mark.gpu
@pytest.mark.parametrize("implementation", ["triton", "mosaic"])
def test_sharding_example_with_kernels(implementation):
    if jax.default_backend() != "gpu":
        pytest.skip("needs a CUDA GPU")
    if implementation == "mosaic" and not runtime.can_run_mosaic_hopper():
        pytest.skip("needs an sm90 GPU")
    errors = _errors(implementation)
    # bf16 operands: the per-device gradients are rounded before their sum.
    assert all(e < 2e-2 for e in errors.values()), errors

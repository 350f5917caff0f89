"""`python -m omni_jax info` reports versions, devices, every backend's availability
with the reason, and the FFI library's state, building nothing."""

from __future__ import annotations

import subprocess
import sys

import pytest

from omni_jax.__main__ import main
from omni_jax.ffi import build


def test_info_names_versions_backends_and_the_library(monkeypatch, capsys):
    monkeypatch.setattr(build, "build_library", lambda *a, **k: pytest.fail("info built"))
    assert main(["info"]) == 0
    out = capsys.readouterr().out
    for expected in ("jax:", "jaxlib:", "devices:", "attention:", "matmul:",
                     "sparse MLA FFI library", "kernels usable:"):
        assert expected in out, expected
    for backend in ("mosaic", "triton", "xla"):
        assert f"  {backend}" in out
    assert "xla             runs here" in out


def test_runs_as_a_module():
    result = subprocess.run([sys.executable, "-m", "omni_jax", "info"], capture_output=True,
                            text=True, check=True)
    assert "attention:" in result.stdout


def test_needs_a_command(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main([])
    assert exit_info.value.code == 2

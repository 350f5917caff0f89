"""Fixtures shared by the tests of `omni_jax`'s public ops."""

import pytest

from pallas_kernels import runtime


@pytest.fixture
def compiled_kernels(monkeypatch):
    """Kernels lowered for CUDA as on a GPU, on any machine (``lower(lowering_platforms=
    ("cuda",))``): for what the Pallas interpreters cannot run, such as a shard_map."""
    monkeypatch.delenv(runtime.INTERPRET_ENV_VAR, raising=False)
    monkeypatch.setattr(runtime, "can_run_triton", lambda: True)
    monkeypatch.setattr(runtime, "can_run_mosaic_hopper", lambda: True)

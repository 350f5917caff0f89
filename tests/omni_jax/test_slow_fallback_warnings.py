"""A fallback more than 2x slower than what the hardware supports warns once, naming
the reason and the remedy; choosing the slow path by name warns nothing."""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import pytest

import omni_jax
from omni_jax import dispatch_log, ffi
from omni_jax.ffi.library import LoadResult
from pallas_kernels import runtime


@pytest.fixture(autouse=True)
def _fresh_warnings(monkeypatch):
    monkeypatch.setattr(dispatch_log, "_warned", set())


@pytest.fixture
def hopper_without_kernels(monkeypatch):
    """An sm90 GPU as the dispatch sees it, where no kernel backend can serve."""
    monkeypatch.delenv(runtime.INTERPRET_ENV_VAR, raising=False)
    monkeypatch.setattr(runtime, "gpu_compute_capability", lambda: (9, 0))
    monkeypatch.setattr(runtime, "can_run_triton", lambda: False)
    monkeypatch.setattr(runtime, "can_run_mosaic_hopper", lambda: False)
    monkeypatch.setattr(runtime, "implementation_preference", lambda: ("mosaic", "triton", "xla"))


def _attend(implementation=None):
    q = jax.ShapeDtypeStruct((1, 128, 2, 64), jnp.bfloat16)
    jax.eval_shape(lambda q: omni_jax.attention(q, q, q, implementation=implementation), q)


def test_attention_on_xla_on_a_gpu_warns_once(hopper_without_kernels):
    with pytest.warns(UserWarning, match="XLA backend on this GPU.*not mosaic.*not triton"):
        _attend()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _attend()  # The same fallback again: no second warning.


def test_choosing_xla_by_name_warns_nothing(hopper_without_kernels):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _attend("xla")


def test_attention_on_a_cpu_warns_nothing():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _attend()


def test_sparse_mla_without_its_library_on_hopper_warns_with_the_remedy(monkeypatch):
    monkeypatch.setattr(ffi, "device_reason", lambda: None)
    monkeypatch.setattr(ffi, "load", lambda: LoadResult(
        path=None, reason="FFI library unavailable: CUTLASS headers not found"))
    q = jax.ShapeDtypeStruct((64, 64, 576), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((128, 1, 576), jnp.bfloat16)
    indices = jax.ShapeDtypeStruct((64, 1, 64), jnp.int32)
    call = lambda q, kv, i: omni_jax.sparse_mla_prefill(q, kv, i, sm_scale=0.1)
    with pytest.warns(UserWarning, match=r"25x slower.*CUTLASS headers not found.*omni-jax\[ffi\]"):
        jax.eval_shape(call, q, kv, indices)

"""Kernels check themselves on first use on hardware they never ran on (sm100)."""

import logging

import jax.numpy as jnp
import numpy as np
import pytest

from omni_jax import first_use_check
from pallas_kernels import runtime


@pytest.fixture
def blackwell(monkeypatch):
    """This process on a (pretended) B200: compiled kernels, compute capability 10.0."""
    monkeypatch.delenv(runtime.INTERPRET_ENV_VAR, raising=False)
    monkeypatch.setattr(runtime, "gpu_compute_capability", lambda: (10, 0))
    first_use_check.reset()
    yield
    first_use_check.reset()


def _calls(values):
    """A function returning ``values`` and counting its calls."""
    def call():
        call.count += 1
        return values

    call.count = 0
    return call


def _reference():
    return jnp.asarray(np.random.default_rng(0).standard_normal((4, 8)), jnp.float32)


def test_a_matching_kernel_passes_and_is_checked_once(blackwell, caplog):
    want = _reference()
    kernel = _calls(want.astype(jnp.bfloat16))
    with caplog.at_level(logging.INFO, logger=first_use_check.__name__):
        for _ in range(3):
            assert first_use_check.verified("config", "the kernel", kernel, lambda: want) is None
    assert kernel.count == 1
    assert "passed" in caplog.text


@pytest.mark.parametrize("wrong", ["off", "nan", "raises", "shape"])
def test_a_wrong_kernel_is_declined_with_a_warning_once(blackwell, caplog, wrong):
    want = _reference()
    if wrong == "raises":
        def kernel():
            raise RuntimeError("illegal instruction")
    else:
        kernel = _calls({"off": want * 1.5, "nan": want * jnp.nan, "shape": want[:2]}[wrong])
    with caplog.at_level(logging.WARNING, logger=first_use_check.__name__):
        reasons = {first_use_check.verified(("k", 1), "the sm100 kernel", kernel,
                                            lambda: want) for _ in range(2)}
    (reason,) = reasons
    assert reason is not None and "first-use check" in reason
    if wrong == "raises":
        assert "illegal instruction" in reason
    assert caplog.text.count("declined") == 1


def test_calls_from_inside_the_check_pass(blackwell):
    """The check's own kernel call dispatches through the code that asks for the check."""
    want = _reference()
    inner = []

    def kernel():
        inner.append(first_use_check.verified("same", "k", kernel, lambda: want))
        return want

    assert first_use_check.verified("same", "k", kernel, lambda: want) is None
    assert inner == [None]


def test_works_while_a_caller_is_traced(blackwell):
    import jax

    want = _reference()
    kernel = _calls(want)

    @jax.jit
    def traced(x):
        assert first_use_check.verified("traced", "k", kernel, lambda: want) is None
        return x + 1

    traced(jnp.ones(2))
    assert kernel.count == 1


@pytest.mark.parametrize("capability, interpret", [((9, 0), ""), (None, ""), ((10, 0), "sm100")])
def test_nothing_is_checked_elsewhere(monkeypatch, capability, interpret):
    monkeypatch.setenv(runtime.INTERPRET_ENV_VAR, interpret)
    monkeypatch.setattr(runtime, "gpu_compute_capability", lambda: capability)
    first_use_check.reset()
    kernel = _calls(jnp.zeros(1))
    assert first_use_check.verified("any", "k", kernel, lambda: jnp.ones(1)) is None
    assert kernel.count == 0

"""On a Blackwell GPU the sm100 GEMM checks each configuration on first use."""

import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import omni_jax
from omni_jax import first_use_check
from omni_jax.matmul import implementations
from pallas_kernels import runtime
from pallas_kernels.matmul_common import problem_of
from pallas_kernels.mosaic import matmul_sm100


@pytest.fixture
def blackwell(monkeypatch):
    """A (pretended) B200 running compiled kernels; none of them is run here."""
    monkeypatch.delenv(runtime.INTERPRET_ENV_VAR, raising=False)
    monkeypatch.setattr(runtime, "gpu_compute_capability", lambda: (10, 0))
    monkeypatch.setattr(runtime, "can_run_triton", lambda: False)
    monkeypatch.setattr(runtime, "implementation_preference",
                        lambda: ("mosaic", "triton", "xla"))  # as on the GPU
    first_use_check.reset()
    yield
    first_use_check.reset()


def _problem(dtype=jnp.bfloat16, **kwargs):
    a = jax.ShapeDtypeStruct((1, 512, 384), dtype)
    b = jax.ShapeDtypeStruct((1, 384, 256), dtype)
    return problem_of(a, b, None, None, transpose_a=False, transpose_b=False,
                      activation=kwargs.get("activation"), out_dtype=jnp.dtype(jnp.bfloat16))


def _widened_reference(a, b, scale, bias, *, out_dtype, config, **options):
    del config
    out = implementations.module("xla").matmul(a.astype(jnp.float32), b.astype(jnp.float32),
                                               scale, bias, out_dtype=jnp.float32, **options)
    return out.astype(out_dtype)


def test_a_correct_kernel_serves_after_one_check(blackwell, monkeypatch):
    calls = []

    def kernel(*args, **kwargs):
        calls.append(kwargs["config"])
        return _widened_reference(*args, **kwargs)

    monkeypatch.setattr(matmul_sm100, "matmul", kernel)
    for _ in range(2):
        assert implementations.why_not("mosaic", _problem()) is None
    assert len(calls) == 1
    assert calls[0] == matmul_sm100.default_config(512, 256, 384, jnp.bfloat16, jnp.bfloat16)


def test_a_wrong_configuration_routes_to_the_next_implementation(blackwell, monkeypatch,
                                                                  caplog):
    def wrong(*args, **kwargs):
        return _widened_reference(*args, **kwargs) * 2

    monkeypatch.setattr(matmul_sm100, "matmul", wrong)
    with caplog.at_level(logging.WARNING, logger=first_use_check.__name__):
        assert implementations.choose(None, _problem()) == "xla"
        assert implementations.choose(None, _problem()) == "xla"
    assert caplog.text.count("declined") == 1 and "relative error" in caplog.text
    with pytest.raises(ValueError, match="first-use check"):
        implementations.choose("mosaic", _problem())
    # Another configuration (an activation) is checked on its own.
    monkeypatch.setattr(matmul_sm100, "matmul", _widened_reference)
    assert implementations.choose(None, _problem(activation="gelu")) == "mosaic"


def test_a_kernel_that_fails_to_compile_is_declined(blackwell):
    """Here the Mosaic kernel cannot compile (no GPU): the call still computes, by XLA."""
    rng = np.random.default_rng(0)
    a = jnp.asarray(rng.standard_normal((256, 128)), jnp.bfloat16)
    b = jnp.asarray(rng.standard_normal((128, 256)), jnp.bfloat16)
    out = omni_jax.matmul(a, b)
    np.testing.assert_allclose(np.asarray(out, np.float32),
                               np.asarray(a, np.float32) @ np.asarray(b, np.float32),
                               rtol=2e-2, atol=2e-1)
    assert "first-use check" in implementations.why_not("mosaic", problem_of(
        a[None], b[None], None, None, transpose_a=False, transpose_b=False, activation=None,
        out_dtype=jnp.dtype(jnp.bfloat16)))

"""On a Blackwell GPU the sm100 attention forward checks each configuration on first use."""

import logging

import jax.numpy as jnp
import numpy as np
import pytest

import omni_jax
from omni_jax import first_use_check
from omni_jax.backends import mosaic
from omni_jax.problem import AttentionProblem
from pallas_kernels import runtime
from pallas_kernels.mosaic import attention_fwd_sm100 as fwd100
from tests import jax_releases
from tests.mosaic_interpret import interpreted_mosaic


@pytest.fixture
def blackwell(monkeypatch):
    """A (pretended) B200 running compiled kernels, the Mosaic backend preferred."""
    monkeypatch.delenv(runtime.INTERPRET_ENV_VAR, raising=False)
    monkeypatch.setattr(runtime, "gpu_compute_capability", lambda: (10, 0))
    monkeypatch.setattr(runtime, "can_run_triton", lambda: False)
    monkeypatch.setattr(runtime, "implementation_preference", lambda: ("mosaic", "xla"))
    first_use_check.reset()
    yield
    first_use_check.reset()


def _inputs(head_dim=64, heads=2, kv_heads=1, length=200):
    rng = np.random.default_rng(1)
    shape = lambda h: (1, length, h, head_dim)
    return tuple(jnp.asarray(rng.standard_normal(shape(h)), jnp.bfloat16)
                 for h in (heads, kv_heads, kv_heads))


def _reference_forward(q, k, v, kmask, layout, **kwargs):
    """What a correct sm100 forward returns: the xla backend's (out, lse)."""
    return omni_jax.attention(q.astype(jnp.float32), k.astype(jnp.float32),
                              v.astype(jnp.float32), is_causal=True, scale=kwargs["scale"],
                              softcap=kwargs["softcap"], return_lse=True, implementation="xla")


def test_a_correct_forward_serves_after_one_check(blackwell, monkeypatch):
    calls = []

    def kernel(*args, **kwargs):
        calls.append(kwargs["config"])
        return _reference_forward(*args, **kwargs)

    monkeypatch.setattr(fwd100, "attention_forward", kernel)
    q, k, v = _inputs()
    assert omni_jax.attention(q, k, v, is_causal=True).shape == q.shape
    checks = len(calls)
    assert checks >= 1  # the check, then the call itself
    omni_jax.attention(q, k, v, is_causal=True)
    assert len(calls) == checks  # jit cache: neither checked nor traced again


def test_a_wrong_forward_routes_to_xla_with_one_warning(blackwell, monkeypatch, caplog):
    def wrong(*args, **kwargs):
        out, lse = _reference_forward(*args, **kwargs)
        return out * 0.5, lse

    monkeypatch.setattr(fwd100, "attention_forward", wrong)
    q, k, v = _inputs()
    with caplog.at_level(logging.WARNING, logger=first_use_check.__name__):
        out = omni_jax.attention(q, k, v, is_causal=True)
        omni_jax.attention(q, k, v, is_causal=True, softcap=None)
    expected = omni_jax.attention(q, k, v, is_causal=True, implementation="xla")
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(expected, np.float32),
                               rtol=2e-2, atol=2e-2)
    assert caplog.text.count("declined") == 1 and "relative error" in caplog.text
    with pytest.raises(ValueError, match="first-use check"):
        omni_jax.attention(q, k, v, is_causal=True, implementation="mosaic")


@pytest.fixture
def interpreted_sm100(monkeypatch):
    jax_releases.skip_unless_blackwell_interpreter()
    yield from interpreted_mosaic(monkeypatch, "sm100")


@pytest.mark.interpreted
def test_the_interpreted_sm100_kernels_pass_their_checks(interpreted_sm100, monkeypatch):
    """The real kernels, interpreted as sm100, through the checks a B200 would run."""
    monkeypatch.setattr(first_use_check, "unverified_hardware", lambda: True)
    first_use_check.reset()
    problem = AttentionProblem(batch=1, q_len=200, kv_len=200, num_q_heads=2,
                               num_kv_heads=1, head_dim=64, head_dim_v=64,
                               dtype=np.dtype(jnp.bfloat16), scale=0.125, softcap=None,
                               score_mod=None, has_sinks=False, has_user_mask=False)
    try:
        backend = mosaic.MosaicBackend()
        assert backend.unsupported_reason(problem) is None
        assert backend.backward_unsupported_reason(problem) is None
    finally:
        first_use_check.reset()

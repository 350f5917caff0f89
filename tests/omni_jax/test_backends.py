"""How `plan_attention` picks the forward and backward backends, and what it logs."""

import logging

import jax.numpy as jnp
import pytest

from omni_jax import dispatch_log
from omni_jax.backends import plan_attention
from omni_jax.problem import AttentionProblem
from pallas_kernels import runtime


def _problem(block_size=None) -> AttentionProblem:
    return AttentionProblem(
        batch=1, q_len=256, kv_len=256, num_q_heads=2, num_kv_heads=1, head_dim=64,
        head_dim_v=64, dtype=jnp.dtype(jnp.bfloat16), scale=0.125, softcap=None,
        score_mod=None, has_sinks=False, has_user_mask=block_size is not None,
        block_size=block_size)


@pytest.fixture(autouse=True)
def _nothing_logged_yet(monkeypatch):
    monkeypatch.setattr(dispatch_log, "_logged", set())


def test_every_plan_is_logged_at_debug(caplog):
    caplog.set_level(logging.DEBUG, logger="omni_jax")
    plan = plan_attention(None, _problem())
    plan_attention(None, _problem())  # the same plan again: not logged again
    messages = [r.getMessage() for r in caplog.records if r.name == "omni_jax.backends"]
    assert len(messages) == 1, messages
    assert f"forward and backward {plan.forward.name!r}" in messages[0]
    assert "256 x 256" in messages[0] and "head dims 64/64" in messages[0]


def test_a_backward_on_another_backend_is_logged_with_the_reason(caplog, monkeypatch):
    """A call the Mosaic forward takes but its backward does not (here: no backward
    config) trains through the next backend, and the INFO record says which and why."""
    from pallas_kernels.mosaic import attention_bwd_sm90 as bwd

    monkeypatch.setenv(runtime.INTERPRET_ENV_VAR, "1")
    monkeypatch.setattr(bwd, "backward_config", lambda *args, **kwargs: None)
    caplog.set_level(logging.INFO, logger="omni_jax")
    plan = plan_attention("mosaic", _problem())
    assert plan.forward.name == "mosaic" and plan.backward.name != "mosaic"
    (record,) = [r for r in caplog.records if r.name == "omni_jax.backends"]
    assert record.levelno == logging.INFO
    message = record.getMessage()
    assert f"forward 'mosaic', backward {plan.backward.name!r}" in message
    assert "not mosaic: head_dim=64, head_dim_v=64" in message, message

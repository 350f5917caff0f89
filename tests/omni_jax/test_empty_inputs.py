"""Calls with nothing to attend: batch, q_len or kv_len 0 (as `jax.nn.dot_product_attention`
takes them). Every query then sees no key: zeros, lse -inf or its sink logit, zero
gradients, under jit, vmap and grad alike."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import omni_jax

# (batch, q_len, kv_len)
SHAPES = {"no keys": (2, 24, 0), "no queries": (2, 0, 40), "no batch": (0, 24, 40)}
HEADS, KV_HEADS, HEAD_DIM, HEAD_DIM_V = 4, 2, 16, 8


def _inputs(batch, q_len, kv_len, dtype):
    rng = np.random.default_rng()
    shapes = ((batch, q_len, HEADS, HEAD_DIM), (batch, kv_len, KV_HEADS, HEAD_DIM),
              (batch, kv_len, KV_HEADS, HEAD_DIM_V))
    return tuple(jnp.asarray(rng.standard_normal(s), dtype) for s in shapes)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("with_sinks", [False, True], ids=["no_sinks", "sinks"])
@pytest.mark.parametrize("shape", SHAPES)
def test_nothing_to_attend(shape, with_sinks, dtype):
    batch, q_len, kv_len = SHAPES[shape]
    q, k, v = _inputs(batch, q_len, kv_len, dtype)
    sinks = jnp.asarray(np.random.default_rng().standard_normal(HEADS), jnp.float32)
    ids = jnp.zeros((batch, q_len), jnp.int32), jnp.zeros((batch, kv_len), jnp.int32)

    def call(q, k, v, sinks):
        return omni_jax.attention(q, k, v, is_causal=True, q_segment_ids=ids[0],
                                  kv_segment_ids=ids[1], sinks=sinks if with_sinks else None,
                                  score_mod=lambda s, b, h, i, j: s * 0.5, return_lse=True)

    out, lse = jax.jit(call)(q, k, v, sinks)
    assert out.shape == (batch, q_len, HEADS, HEAD_DIM_V) and out.dtype == dtype
    assert lse.shape == (batch, HEADS, q_len) and lse.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(out, np.float32), 0.0)
    expected_lse = np.broadcast_to(np.asarray(sinks)[None, :, None] if with_sinks else -np.inf,
                                   lse.shape)
    np.testing.assert_array_equal(np.asarray(lse), expected_lse)
    if kv_len == 0 and not with_sinks:  # as jax.nn.dot_product_attention (value dim = key's)
        k_heads = jnp.repeat(k, HEADS // KV_HEADS, 2)
        np.testing.assert_array_equal(
            np.asarray(omni_jax.attention(q, k, k), np.float32),
            np.asarray(jax.nn.dot_product_attention(q, k_heads, k_heads), np.float32))

    def loss(q, k, v, sinks):
        out, lse = call(q, k, v, sinks)
        return out.astype(jnp.float32).sum() + jnp.where(jnp.isfinite(lse), lse, 0.0).sum()

    grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))(q, k, v, sinks)
    for grad, operand in zip(grads[:3], (q, k, v), strict=True):
        assert grad.shape == operand.shape
        np.testing.assert_array_equal(np.asarray(grad, np.float32), 0.0)
    # Each sink logit is its rows' lse: d loss / d sink = the number of its rows.
    np.testing.assert_array_equal(np.asarray(grads[3]), batch * q_len if with_sinks else 0.0)


def test_vmap_over_empty_calls():
    q, k, v = _inputs(2, 24, 0, jnp.float32)
    out = jax.vmap(lambda q, k, v: omni_jax.attention(q, k, v))(q[:, None], k[:, None],
                                                                 v[:, None])
    assert out.shape == (2, 1, 24, HEADS, HEAD_DIM_V)
    np.testing.assert_array_equal(np.asarray(out), 0.0)

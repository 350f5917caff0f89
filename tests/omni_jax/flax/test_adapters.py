"""`attention_fn` adapters inside Flax's own attention modules, against Flax's attention."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from omni_jax.flax import block_mask_from_dense, make_attention_fn
from tests.reference import relative_error

ATTENTION_FN = make_attention_fn(implementation="xla", block_size=(8, 8))
BATCH, SEQ, FEATURES, HEADS = 2, 20, 16, 2
TOLERANCE = 2e-5


def nnx_pair(**kwargs):
    """Flax's nnx.MultiHeadAttention with its own and with our attention_fn, same params."""
    make = lambda **extra: nnx.MultiHeadAttention(HEADS, FEATURES, decode=False,
                                                  rngs=nnx.Rngs(0), **kwargs, **extra)
    return make(), make(attention_fn=ATTENTION_FN)


def kv_padding_mask():
    valid = np.ones((BATCH, SEQ), bool)
    valid[1, 13:] = False  # keys only: every query keeps some visible key
    return nnx.make_attention_mask(jnp.ones((BATCH, SEQ), bool), jnp.asarray(valid))


@pytest.mark.parametrize("masking", ["causal_mask", "is_causal", "kv_padding_and_causal"])
def test_nnx_multi_head_attention(masking, seed):
    flax_mha, omni_mha = nnx_pair()
    x = jax.random.normal(jax.random.key(seed), (BATCH, SEQ, FEATURES))
    kwargs = {
        "causal_mask": dict(mask=nnx.make_causal_mask(jnp.ones((BATCH, SEQ)))),
        "is_causal": dict(is_causal=True),
        "kv_padding_and_causal": dict(mask=kv_padding_mask(), is_causal=True),
    }[masking]
    assert relative_error(omni_mha(x, **kwargs), flax_mha(x, **kwargs)) < TOLERANCE


def test_nnx_multi_head_attention_decode(seed):
    flax_mha, omni_mha = nnx_pair()
    x = jax.random.normal(jax.random.key(seed), (BATCH, 6, FEATURES))
    for mha in (flax_mha, omni_mha):
        mha.init_cache((BATCH, 8, FEATURES))
    for t in range(6):
        token = x[:, t:t + 1]
        expected = flax_mha(token, decode=True)
        assert relative_error(omni_mha(token, decode=True), expected) < TOLERANCE


def test_linen_multi_head_dot_product_attention(seed):
    x = jax.random.normal(jax.random.key(seed), (BATCH, SEQ, FEATURES))
    mask = nn.make_causal_mask(jnp.ones((BATCH, SEQ)))
    flax_mha = nn.MultiHeadDotProductAttention(num_heads=HEADS)
    omni_mha = nn.MultiHeadDotProductAttention(num_heads=HEADS, attention_fn=ATTENTION_FN)
    variables = flax_mha.init(jax.random.key(seed + 1), x, mask=mask)
    expected = flax_mha.apply(variables, x, mask=mask)
    assert relative_error(omni_mha.apply(variables, x, mask=mask), expected) < TOLERANCE


def test_extra_batch_dims_bias_and_mask_match_flax(seed):
    keys = jax.random.split(jax.random.key(seed), 4)
    q, k, v = (jax.random.normal(key, (2, 2, 12, HEADS, 8)) for key in keys[:3])
    bias = jax.random.normal(keys[3], (2, 2, HEADS, 12, 12))
    mask = jnp.tril(jnp.ones((12, 12), bool)) | (jnp.arange(12) < 3)
    expected = nnx.dot_product_attention(q, k, v, bias=bias, mask=mask)
    out = ATTENTION_FN(q, k, v, bias=bias, mask=mask)
    assert out.shape == expected.shape
    assert relative_error(out, expected) < TOLERANCE
    grad = jax.grad(lambda b: ATTENTION_FN(q, k, v, bias=b, mask=mask).sum())(bias)
    expected_grad = jax.grad(lambda b: nnx.dot_product_attention(q, k, v, bias=b,
                                                                 mask=mask).sum())(bias)
    assert relative_error(grad, expected_grad) < 1e-4


def test_block_mask_from_dense_round_trips(seed):
    mask = jax.random.bernoulli(jax.random.key(seed), 0.3, (2, 1, 19, 27))
    mask = mask.at[:, :, :8, :8].set(True).at[:, :, 8:16, :8].set(False)  # FULL and empty
    block_mask = block_mask_from_dense(mask, (8, 8))
    np.testing.assert_array_equal(np.asarray(block_mask.to_dense()).reshape(mask.shape),
                                  np.asarray(mask))


def test_what_cannot_be_mapped_raises():
    q = jnp.ones((1, 4, HEADS, 8))
    with pytest.raises(NotImplementedError, match="dropout"):
        ATTENTION_FN(q, q, q, dropout_rate=0.1, deterministic=False)
    ATTENTION_FN(q, q, q, dropout_rate=0.1, deterministic=True)  # dropout off: fine
    mha = nnx.MultiHeadAttention(HEADS, FEATURES, decode=False, attention_fn=ATTENTION_FN,
                                 rngs=nnx.Rngs(0))
    with pytest.raises(NotImplementedError, match="sow_weights"):
        mha(jnp.ones((1, 4, FEATURES)), sow_weights=True)
    with pytest.raises(ValueError, match="mask has rank"):
        ATTENTION_FN(q, q, q, mask=jnp.ones((1, 1, 1, 4, 4), bool))

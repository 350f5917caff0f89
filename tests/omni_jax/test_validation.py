"""Bad arguments raise at trace time, naming the argument, the expected and the actual value."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import omni_jax


def _arrays(q_shape=(2, 32, 4, 16), kv_shape=(2, 48, 2, 16), v_shape=None, dtype=jnp.float32):
    rng = np.random.default_rng()
    v_shape = v_shape or kv_shape
    return tuple(jnp.asarray(rng.standard_normal(s), dtype) for s in (q_shape, kv_shape, v_shape))


def _mask(q_len, kv_len, batch=None):
    return omni_jax.create_block_mask(omni_jax.causal_mask, batch, None, q_len, kv_len, (16, 16))


CASES = {
    "query rank": (dict(arrays=dict(q_shape=(32, 4, 16))), ValueError, r"query must have rank 4"),
    "no heads": (dict(arrays=dict(q_shape=(2, 32, 0, 16), kv_shape=(2, 48, 0, 16))), ValueError,
                 r"query needs at least one head and a head_dim of at least 1, got shape "
                 r"\(2, 32, 0, 16\)"),
    "empty head_dim": (dict(arrays=dict(kv_shape=(2, 48, 2, 0))), ValueError,
                       r"key needs at least one head and a head_dim of at least 1"),
    "dtype mismatch": (dict(dtypes=(jnp.float32, jnp.bfloat16, jnp.bfloat16)), TypeError,
                       r"one dtype, got float32, bfloat16"),
    "integer inputs": (dict(dtypes=(jnp.int32,) * 3), TypeError, r"bfloat16, float16, float32"),
    "batch": (dict(arrays=dict(kv_shape=(3, 48, 2, 16))), ValueError, r"batch size, got 2, 3"),
    "kv lengths": (dict(arrays=dict(v_shape=(2, 40, 2, 16))), ValueError,
                   r"key 48 and value 40|key 48.*40"),
    "gqa": (dict(arrays=dict(kv_shape=(2, 48, 3, 16))), ValueError, r"multiple of key/value"),
    "[batch, heads, seq, dim] layout": (
        dict(arrays=dict(q_shape=(2, 4, 32, 16), kv_shape=(2, 2, 48, 16))), ValueError,
        r"got query 32 heads and key/value 48 heads \(the layout is \[batch, seq_len, "
        r"num_heads, head_dim\]; transpose .*swapaxes\(1, 2\)"),
    "head_dim": (dict(arrays=dict(kv_shape=(2, 48, 2, 8), v_shape=(2, 48, 2, 16))), ValueError,
                 r"key head_dim must equal query head_dim 16, got 8"),
    "window": (dict(kwargs=dict(local_window_size=(1, 2, 3))), ValueError, r"local_window_size"),
    "negative_window": (dict(kwargs=dict(local_window_size=-3)), ValueError,
                        r"local_window_size must be .*, got -3"),
    "segment shape": (dict(kwargs=dict(q_segment_ids=jnp.zeros((2, 31), jnp.int32),
                                       kv_segment_ids=jnp.zeros((2, 48), jnp.int32))),
                      ValueError, r"q_segment_ids must have shape \[batch, seq_len\] = \(2, 32\)"),
    "segment dtype": (dict(kwargs=dict(q_segment_ids=jnp.zeros((2, 32)),
                                       kv_segment_ids=jnp.zeros((2, 48), jnp.int32))),
                      TypeError, r"q_segment_ids must be an integer array"),
    "one segment id for different lengths": (
        dict(kwargs=dict(q_segment_ids=jnp.zeros((2, 32), jnp.int32))), ValueError,
        r"q_len 32 != kv_len 48"),
    "mask lengths": (dict(kwargs=dict(mask=_mask(32, 32))), ValueError,
                     r"mask was built for \(q_len, kv_len\) = \(32, 32\).*\(32, 48\)"),
    "mask batch": (dict(kwargs=dict(mask=omni_jax.create_block_mask(
        omni_jax.document_mask(jnp.zeros((3, 32), jnp.int32), jnp.zeros((3, 48), jnp.int32)),
        3, None, 32, 48, 16))), ValueError, r"mask batch size must be 1 or 2, got 3"),
    "mask built under vmap": (dict(kwargs=dict(mask=jax.vmap(
        lambda ids: omni_jax.create_block_mask(omni_jax.document_mask(ids[:, :32], ids), None,
                                               None, 32, 48, 16))(jnp.zeros((3, 1, 48), int)))),
        ValueError, r"mask has leading axes \(3,\) besides \(batch, heads\)"),
    "mask type": (dict(kwargs=dict(mask=jnp.ones((32, 48), bool))), TypeError,
                  r"mask must be an omni_jax.BlockMask"),
    "score_mod": (dict(kwargs=dict(score_mod="alibi")), TypeError, r"score_mod must be callable"),
    "softcap": (dict(kwargs=dict(softcap=-1.0)), ValueError,
                r"softcap must be a finite positive number, got -1.0"),
    "infinite softcap": (dict(kwargs=dict(softcap=float("inf"))), ValueError,
                         r"softcap must be a finite positive number, got inf"),
    "nan scale": (dict(kwargs=dict(scale=float("nan"))), ValueError,
                  r"scale must be a finite number, got nan"),
    "traced softcap": (dict(kwargs=dict(softcap=jnp.float32(2.0))), TypeError,
                       r"softcap must be a Python float"),
    "sinks": (dict(kwargs=dict(sinks=jnp.zeros((2,)))), ValueError,
              r"sinks must have shape \[num_q_heads\] = \(4,\), got \(2,\)"),
    "implementation": (dict(kwargs=dict(implementation="cuda")), ValueError,
                       r"implementation must be one of"),
    "is_causal": (dict(kwargs=dict(is_causal="yes")), TypeError,
                  r"is_causal must be a Python bool .*got str"),
    "array is_causal": (dict(kwargs=dict(is_causal=jnp.array(True))), TypeError,
                        r"is_causal must be a Python bool \(static"),
    "deterministic": (dict(kwargs=dict(deterministic=None)), TypeError,
                      r"deterministic must be a Python bool .*got NoneType"),
}


@pytest.mark.parametrize("name", CASES)
def test_bad_argument_is_named(name):
    spec, error, message = CASES[name]
    q, k, v = _arrays(**spec.get("arrays", {}))
    if "dtypes" in spec:
        q, k, v = (x.astype(d) for x, d in zip((q, k, v), spec["dtypes"], strict=True))
    kwargs = spec.get("kwargs", {})
    with pytest.raises(error, match=message):
        omni_jax.attention(q, k, v, **kwargs)
    # The same error at trace time, before anything runs.
    with pytest.raises(error, match=message):
        jax.jit(lambda q, k, v: omni_jax.attention(q, k, v, **kwargs)).lower(q, k, v)


def test_backend_that_cannot_serve_says_why(monkeypatch):
    """Naming a Pallas backend on a CPU without interpret mode is an error; None is never."""
    monkeypatch.delenv("OMNI_JAX_PALLAS_INTERPRET", raising=False)
    if jax.default_backend() == "gpu":
        pytest.skip("on a GPU the Pallas backends can serve")
    q, k, v = _arrays()
    for name in ("triton", "mosaic"):
        with pytest.raises(ValueError, match=rf"implementation='{name}' cannot serve this call"):
            omni_jax.attention(q, k, v, implementation=name)
    assert omni_jax.attention(q, k, v).shape == (2, 32, 4, 16)

"""`attention_fn` adapters: `omni_jax.attention` as a drop-in for Flax's attention modules.

``flax.nnx.MultiHeadAttention(..., attention_fn=attention_fn)`` and
``flax.linen.MultiHeadDotProductAttention(..., attention_fn=attention_fn)``
call it like `flax.nnx.dot_product_attention`. What translates:

* ``query/key/value [batch..., seq, heads, head_dim]``: any number of batch
  dims (flattened into one); fewer key/value heads (GQA) pass through.
* ``mask``: a boolean array broadcastable to ``[batch..., heads, q_len, kv_len]``
  (True = attend). A dense mask has no structure to exploit, so it becomes a
  `BlockMask` whose every mixed tile is a stored boolean tile: fully masked
  tiles are still skipped, but the mask costs O(q_len x kv_len) memory, as
  it did already. Prefer ``is_causal`` (nnx) or the `omni_jax.flax.Attention`
  layer, whose masks are structured.
* ``bias``: added to the scores through a ``score_mod`` (differentiable).
* ``is_causal``, ``dtype`` (inputs are cast to it).
* dropout: only ``dropout_rate == 0`` or ``deterministic=True``; otherwise a
  NotImplementedError (the probabilities are never materialised).

Not supported: ``module`` (``sow_weights=True``: there are no weights to sow),
which raises. ``precision`` is ignored (softmax statistics are float32).
Unlike Flax, a query whose keys are all masked gets zeros, not a uniform
average of all values.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import jax.numpy as jnp

import omni_jax
from omni_jax.masks import FULL, MASKED, PARTIAL, BlockMask

Array = Any


def block_mask_from_dense(mask: Array, block_size: tuple[int, int] = (128, 128)) -> BlockMask:
    """A `BlockMask` from a boolean ``mask [batch|1, heads|1, q_len, kv_len]`` (jittable).

    Tiles all True are FULL, all False are skipped, mixed ones are stored:
    every tile gets a slot in ``partial_masks`` (its size cannot depend on
    traced values), so this is exact but not compact.
    """
    mask = jnp.asarray(mask, bool)
    batch, heads, q_len, kv_len = mask.shape
    block_q, block_kv = block_size
    nq, nkv = -(-q_len // block_q), -(-kv_len // block_kv)
    padded = jnp.pad(mask, ((0, 0), (0, 0), (0, nq * block_q - q_len),
                            (0, nkv * block_kv - kv_len)))
    tiles = padded.reshape(batch, heads, nq, block_q, nkv, block_kv).swapaxes(3, 4)
    # Padding counts as visible for "all visible": kernels bound kv_idx < kv_len themselves.
    in_bounds = jnp.pad(jnp.ones((q_len, kv_len), bool), ((0, nq * block_q - q_len),
                                                          (0, nkv * block_kv - kv_len)))
    in_bounds = in_bounds.reshape(nq, block_q, nkv, block_kv).swapaxes(1, 2)
    any_visible = tiles.any(axis=(-2, -1))
    all_visible = (tiles | ~in_bounds).all(axis=(-2, -1))
    flags = jnp.where(any_visible, jnp.where(all_visible, FULL, PARTIAL), MASKED)
    ids = jnp.arange(batch * heads * nq * nkv, dtype=jnp.int32).reshape(flags.shape)
    ids = jnp.where(flags == PARTIAL, ids, -1)
    stored = tiles.reshape(-1, block_q, block_kv)
    return BlockMask.from_tile_flags(flags, ids, stored, None, q_len=q_len, kv_len=kv_len,
                                     block_size=block_size)


def _to_rank4(x: Array, batch_dims: tuple[int, ...], name: str) -> Array:
    """A ``[batch..., heads, q, kv]``-broadcastable array as ``[batch|1, heads|1, q|1, kv|1]``."""
    rank = len(batch_dims) + 3
    if x.ndim > rank:
        raise ValueError(f"{name} has rank {x.ndim}, more than query's {rank} "
                         f"([batch..., heads, q_len, kv_len])")
    x = x.reshape((1,) * (rank - x.ndim) + x.shape)
    lead = x.shape[:len(batch_dims)]
    if all(d == 1 for d in lead):
        return x.reshape(1, *x.shape[len(batch_dims):])
    x = jnp.broadcast_to(x, batch_dims + x.shape[len(batch_dims):])
    return x.reshape(math.prod(batch_dims), *x.shape[len(batch_dims):])


def _bias_score_mod(bias: Array) -> Callable:
    """A score_mod adding ``bias [B|1, H|1, q|1, kv|1]`` to each score."""

    def score_mod(score, b, h, q_idx, kv_idx):
        index = tuple(i if size > 1 else 0 for i, size in zip((b, h, q_idx, kv_idx),
                                                              bias.shape, strict=True))
        return score + bias[index].astype(score.dtype)

    return score_mod


def make_attention_fn(*, implementation: str | None = None,
                      block_size: tuple[int, int] = (128, 128),
                      softcap: float | None = None,
                      deterministic_gradients: bool = True) -> Callable[..., Array]:
    """An ``attention_fn`` for Flax attention modules that runs `omni_jax.attention`.

    Args:
      implementation: the `omni_jax.attention` backend (None: best available).
      block_size: tile size of the BlockMask built from a dense ``mask``.
      softcap: logit softcap (Flax's modules have no such option).
      deterministic_gradients: `omni_jax.attention`'s ``deterministic`` (Flax's own
        ``deterministic`` argument is about dropout).
    """

    def attention_fn(query: Array, key: Array, value: Array, bias: Array | None = None,
                     mask: Array | None = None, broadcast_dropout: bool = True,
                     dropout_rng: Array | None = None, dropout_rate: float = 0.0,
                     deterministic: bool = False, dtype: Any = None, precision: Any = None,
                     module: Any = None, is_causal: bool = False) -> Array:
        """`flax.nnx.dot_product_attention`'s signature, computed by `omni_jax.attention`."""
        del broadcast_dropout, dropout_rng, precision
        if dropout_rate > 0.0 and not deterministic:
            raise NotImplementedError(
                "omni_jax attention_fn: attention dropout is not implemented (probabilities "
                "are never materialised); use dropout_rate=0 or deterministic=True")
        if module is not None:
            raise NotImplementedError("omni_jax attention_fn: sow_weights=True is not "
                                      "supported (attention weights are never materialised)")
        dtype = dtype or jnp.result_type(query, key, value)
        query, key, value = (x.astype(dtype) for x in (query, key, value))
        *batch_dims, q_len, heads, head_dim = query.shape
        batch_dims = tuple(batch_dims)
        kv_len = key.shape[-3]
        flat = lambda x: x.reshape(math.prod(batch_dims), *x.shape[len(batch_dims):])
        block_mask = None
        if mask is not None:
            dense = _to_rank4(jnp.asarray(mask, bool), batch_dims, "mask")
            dense = jnp.broadcast_to(dense, (*dense.shape[:2], q_len, kv_len))
            block_mask = block_mask_from_dense(dense, block_size)
        score_mod = None
        if bias is not None:
            score_mod = _bias_score_mod(_to_rank4(jnp.asarray(bias), batch_dims, "bias"))
        out = omni_jax.attention(flat(query), flat(key), flat(value), mask=block_mask,
                                 is_causal=bool(is_causal), score_mod=score_mod,
                                 softcap=softcap, implementation=implementation,
                                 deterministic=deterministic_gradients)
        return out.reshape(*batch_dims, q_len, heads, value.shape[-1])

    return attention_fn


attention_fn = make_attention_fn()
attention_fn.__doc__ = ("`flax.nnx.dot_product_attention`-compatible attention_fn on "
                        "`omni_jax.attention` (default backend); see `make_attention_fn`.")

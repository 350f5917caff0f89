"""Dense float64 reference attention, written independently of omni_jax's backends.

Materialises the whole ``[B, H, Sq, Skv]`` score matrix in float64: only for
the small shapes tests use. Gradients come from `jax.vjp` of this function.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np


def dense_mask(batch: int, heads: int, q_len: int, kv_len: int, *, is_causal: bool = False,
               window: tuple[int, int] | None = None, q_segment_ids=None, kv_segment_ids=None,
               mask_fn: Callable | None = None) -> np.ndarray:
    """Boolean ``[B, H, Sq, Skv]`` mask from the attention arguments (numpy, elementwise)."""
    q = np.arange(q_len)[:, None]
    k = np.arange(kv_len)[None, :]
    visible = np.ones((batch, heads, q_len, kv_len), bool)
    if is_causal:
        visible &= k <= q
    if window is not None:
        visible &= (k >= q - window[0]) & (k <= q + window[1])
    if q_segment_ids is not None:
        q_ids = np.asarray(q_segment_ids)[:, None, :, None]
        kv_ids = np.asarray(kv_segment_ids)[:, None, None, :]
        visible &= q_ids == kv_ids
    if mask_fn is not None:  # Evaluated once on broadcast index arrays (numpy operators).
        b = np.arange(batch)[:, None, None, None]
        h = np.arange(heads)[None, :, None, None]
        visible &= np.broadcast_to(np.asarray(mask_fn(b, h, q[None, None], k[None, None]), bool),
                                   visible.shape)
    return visible


def reference_attention(q, k, v, mask: np.ndarray | None, *, scale: float | None = None,
                        softcap: float | None = None, score_mod: Callable | None = None,
                        sinks=None):
    """(out, lse) in float64; call inside ``jax.enable_x64(True)``."""
    q, k, v = (jnp.asarray(x, jnp.float64) for x in (q, k, v))
    batch, q_len, heads, dim = q.shape
    kv_len, kv_heads = k.shape[1:3]
    group = heads // kv_heads
    k = jnp.repeat(k, group, axis=2)
    v = jnp.repeat(v, group, axis=2)
    scale = 1.0 / np.sqrt(dim) if scale is None else scale
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k) * scale
    if softcap is not None:
        s = softcap * jnp.tanh(s / softcap)
    if score_mod is not None:
        b, h, i, j = np.meshgrid(np.arange(batch), np.arange(heads), np.arange(q_len),
                                 np.arange(kv_len), indexing="ij")
        flat = jax.vmap(score_mod)(s.ravel(), *(jnp.asarray(x.ravel(), jnp.int32)
                                                for x in (b, h, i, j)))
        s = flat.reshape(s.shape).astype(jnp.float64)
    if mask is not None:
        s = jnp.where(jnp.asarray(mask), s, -jnp.inf)
    if sinks is not None:
        sink = jnp.broadcast_to(jnp.asarray(sinks, jnp.float64)[None, :, None, None],
                                (*s.shape[:3], 1))
        s = jnp.concatenate([s, sink], axis=-1)
    row_max = s.max(axis=-1, keepdims=True)
    row_max = jnp.where(jnp.isfinite(row_max), row_max, 0)
    p = jnp.exp(s - row_max)
    total = p.sum(axis=-1, keepdims=True)
    lse = jnp.where(total[..., 0] > 0, jnp.log(jnp.where(total > 0, total, 1))[..., 0]
                    + row_max[..., 0], -jnp.inf)
    p = jnp.where(total > 0, p / jnp.where(total > 0, total, 1), 0)
    if sinks is not None:
        p = p[..., :-1]
    return jnp.einsum("bhqk,bkhd->bqhd", p, v), lse


def _finite_difference(actual, expected) -> tuple[np.ndarray, np.ndarray] | None:
    """(actual - expected, expected) in float64 with the entries where ``expected`` is not
    finite zeroed, or None when ``actual`` differs there (NaN, another infinity)."""
    actual = np.asarray(actual, np.float64)
    expected = np.asarray(expected, np.float64)
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    finite = np.isfinite(expected)
    if not np.array_equal(np.isfinite(actual), finite) or not np.array_equal(
            actual[~finite], expected[~finite]):
        return None
    expected = np.where(finite, expected, 0)
    return np.where(finite, actual, 0) - expected, expected


def relative_error(actual, expected) -> float:
    """||actual - expected|| / ||expected|| in float64 (inf if actual has NaN/inf where
    expected is finite)."""
    parts = _finite_difference(actual, expected)
    if parts is None:
        return float("inf")
    diff, expected = parts
    return float(np.linalg.norm(diff) / max(np.linalg.norm(expected), 1e-30))


def worst_block_error(actual, expected, axis: int, rows: int = 32,
                      floor: float = 1e-3) -> float:
    """The largest relative error over blocks of ``rows`` along ``axis``: a wrong tile at
    the end of a long sequence fails it, where it can hide in the norm of the whole.

    Each block's error is relative to its own norm, or to ``floor`` times the root mean
    square block norm if larger: a block of gradients too small for the dtype (1e-8 in
    float16 rounds to zero) is judged on the tensor's scale, not its own.
    """
    parts = _finite_difference(actual, expected)
    if parts is None:
        return float("inf")
    diff, expected = parts
    cuts = list(range(rows, expected.shape[axis], rows))
    block_norms = [np.linalg.norm(e) for e in np.split(expected, cuts, axis)]
    scale = floor * np.sqrt(np.mean(np.square(block_norms)))
    return max(np.linalg.norm(d) / max(n, scale, 1e-30)
               for d, n in zip(np.split(diff, cuts, axis), block_norms, strict=True))

"""Rotary position embeddings (RoPE), the rotate-half (GPT-NeoX / Llama) variant.

Positions are explicit ``[batch, seq]`` integers rather than implied by the
array index, because the two places that need them do not count from 0 at
the array start: packed documents restart at 0 in every document, and a
KV-cache decode step continues from the cache's current length.
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
from jax import lax

Array = Any


def apply_rope(x: Array, positions: Array, *, base: float = 10_000.0) -> Array:
    """Rotates ``x [batch, seq, heads, head_dim]`` by its ``positions [batch|1, seq]``.

    Feature pairs ``(i, i + head_dim / 2)`` are rotated by the angle
    ``position * base ** (-2 i / head_dim)``; computed in float32 and returned
    in x's dtype. ``head_dim`` must be even.
    """
    head_dim = x.shape[-1]
    if head_dim % 2:
        raise ValueError(f"RoPE needs an even head_dim, got {head_dim}")
    half = head_dim // 2
    inv_freq = base ** (-jnp.arange(half, dtype=jnp.float32) / half)
    angles = jnp.asarray(positions, jnp.float32)[..., None] * inv_freq  # [b, s, half]
    sin, cos = jnp.sin(angles)[:, :, None, :], jnp.cos(angles)[:, :, None, :]
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    rotated = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return rotated.astype(x.dtype)


def segment_positions(segment_ids: Array) -> Array:
    """Position of each token inside its document: 0 where the segment id changes.

    ``segment_ids [batch, seq]`` must hold each document contiguously (packing).
    """
    seq = segment_ids.shape[-1]
    index = jnp.arange(seq, dtype=jnp.int32)
    starts = jnp.concatenate([jnp.ones_like(segment_ids[:, :1], bool),
                              segment_ids[:, 1:] != segment_ids[:, :-1]], axis=1)
    start_index = jnp.where(starts, index, 0)
    # The latest document start at or before each token (a running max).
    return index - lax.cummax(start_index, axis=1)

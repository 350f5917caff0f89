"""Where each device's shard of a context-parallel sequence lies in the global one.

``"contiguous"``: device i holds positions ``[i * L, (i + 1) * L)`` of a global
sequence of ``n * L``. ``"zigzag"``: the global sequence is cut into ``2n`` chunks
and device i holds chunks i and ``2n - 1 - i``, so that under a causal mask every
device has the same number of visible (query, key) pairs. `zigzag` / `unzigzag`
reorder a global array between the two.
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp

Array = Any
LAYOUTS = ("contiguous", "zigzag")


def check_layout(layout: str, shard_len: int) -> None:
    """Raises unless ``layout`` is known and a shard of ``shard_len`` positions fits it."""
    if layout not in LAYOUTS:
        raise ValueError(f"context_layout must be one of {LAYOUTS}, got {layout!r}")
    if layout == "zigzag" and shard_len % 2:
        raise ValueError(f"context_layout='zigzag' splits each device's shard into two "
                         f"chunks: the local sequence length must be even, got {shard_len}")


def shard_positions(layout: str, shard: Any, num_shards: int, shard_len: int) -> Array:
    """Global positions (int32 ``[shard_len]``) of the shard that device ``shard`` (an
    int or a traced index) holds."""
    if layout == "contiguous":
        return shard * shard_len + jnp.arange(shard_len, dtype=jnp.int32)
    half = shard_len // 2
    steps = jnp.arange(half, dtype=jnp.int32)
    return jnp.concatenate([shard * half + steps, (2 * num_shards - 1 - shard) * half + steps])


def shard_ranges(layout: str, shard: int, num_shards: int,
                 shard_len: int) -> list[tuple[int, int]]:
    """The global positions of `shard_positions` as inclusive ``(first, last)`` runs."""
    if layout == "contiguous":
        return [(shard * shard_len, (shard + 1) * shard_len - 1)]
    half = shard_len // 2
    return [(c * half, (c + 1) * half - 1) for c in (shard, 2 * num_shards - 1 - shard)]


def zigzag(x: Array, axis_size: int, seq_axis: int = 1) -> Array:
    """A global array reordered along ``seq_axis`` so that its ``axis_size`` equal
    contiguous shards are the zigzag shards: shard i is chunks i and ``2n - 1 - i``."""
    chunks = _chunks(x, axis_size, seq_axis)
    order = [c for i in range(axis_size) for c in (i, 2 * axis_size - 1 - i)]
    return jnp.concatenate([chunks[c] for c in order], axis=seq_axis)


def unzigzag(x: Array, axis_size: int, seq_axis: int = 1) -> Array:
    """The inverse of `zigzag`: a zigzag-ordered array back in global order."""
    chunks = _chunks(x, axis_size, seq_axis)
    order = [c for i in range(axis_size) for c in (i, 2 * axis_size - 1 - i)]
    where = {c: k for k, c in enumerate(order)}
    return jnp.concatenate([chunks[where[c]] for c in range(2 * axis_size)], axis=seq_axis)


def _chunks(x: Array, axis_size: int, seq_axis: int) -> list:
    length = x.shape[seq_axis]
    if axis_size < 1 or length % (2 * axis_size):
        raise ValueError(f"zigzag: the sequence length along axis {seq_axis} must be a "
                         f"multiple of 2 * axis_size = {2 * axis_size}, got {length}")
    return jnp.split(x, 2 * axis_size, axis=seq_axis)

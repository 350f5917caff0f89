"""What every paged-attention implementation agrees on: which keys a query sees.

A sequence of ``kv_len`` tokens lives in pages of ``page_size`` tokens listed in its
row of the page table; its ``q_len`` queries are its last tokens, so query ``t`` sits
at position ``kv_len - q_len + t`` (causal masks align bottom-right). The functions
here are plain jnp on arrays of positions, so the XLA reference and the kernels
evaluate the same expressions.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp

Array = Any


@dataclasses.dataclass(frozen=True)
class PagedScores:
    """The static part of a paged-attention call: which keys count and how scores are made."""

    q_len: int
    is_causal: bool
    window: tuple[int, int] | None  # (left, right) of each query's position
    softcap: float | None
    scale: float

    def query_position(self, kv_len: Array, t: Array) -> Array:
        """Sequence position of query ``t`` of a sequence of ``kv_len`` tokens."""
        return kv_len - self.q_len + t

    def visible(self, q_pos: Array, k_pos: Array, kv_len: Array) -> Array:
        """Whether the key at ``k_pos`` counts for the query at ``q_pos`` (broadcasting).
        Window sides (up to int32's max) meet differences of positions, which cannot
        overflow where a position plus a side could."""
        seen = (k_pos < kv_len) & (k_pos >= 0)
        if self.is_causal:
            seen &= k_pos <= q_pos
        if self.window is not None:
            left, right = self.window
            seen &= (q_pos - k_pos <= left) & (k_pos - q_pos <= right)
        return seen

    def key_range(self, kv_len: Array, first_t: Array, last_t: Array) -> tuple[Array, Array]:
        """``[lo, hi)``: the only keys queries ``first_t..last_t`` may see, for kernels
        that skip the tiles outside it."""
        lo, hi = self._key_bounds(kv_len, first_t, last_t)
        return lo, jnp.maximum(hi, lo)

    def shared_key_range(self, kv_len: Array, first_t: Array,
                         last_t: Array) -> tuple[Array, Array]:
        """``[lo, hi)``: keys that every query of ``first_t..last_t`` sees (empty when
        ``hi <= lo``): tiles inside it need no mask."""
        return self._key_bounds(kv_len, last_t, first_t)

    def _key_bounds(self, kv_len: Array, low_t: Array, high_t: Array) -> tuple[Array, Array]:
        """The window's left edge as seen from query ``low_t`` and the window's right
        edge (or the causal diagonal) as seen from query ``high_t``."""
        lo, hi = jnp.int32(0), kv_len
        if self.window is not None:
            left, right = self.window
            low_pos = self.query_position(kv_len, low_t)
            lo = jnp.where(low_pos > left, low_pos - left, 0)
            if not self.is_causal:  # min(hi, high_pos + right + 1), without overflowing
                high_pos = self.query_position(kv_len, high_t)
                hi = jnp.where(hi - high_pos > right, high_pos + right + 1, hi)
        if self.is_causal:
            hi = jnp.minimum(hi, self.query_position(kv_len, high_t) + 1)
        return lo, hi

    def scores(self, qk: Array) -> Array:
        """Scaled (then softcapped) scores from raw ``q . k`` products."""
        s = qk * self.scale
        if self.softcap is not None:
            s = self.softcap * jnp.tanh(s / self.softcap)
        return s


def page_rows(k_pos: Array, *, page_size: int, num_pages: int,
              pages_per_seq: int, load_ids: Any) -> tuple[Array, Array]:
    """(row of the flattened ``[num_pages * page_size]`` cache, whether that row is a real
    page of the table) for each key position ``k_pos``.

    ``load_ids(slots)`` reads the table's page ids at ``slots`` (clamped into the table).
    Page ids outside ``[0, num_pages)`` (a free slot's -1, garbage under jit) are clamped
    for the address and reported as not real, so no read leaves the cache.
    """
    slot = k_pos // page_size
    in_table = (slot >= 0) & (slot < pages_per_seq)
    page = load_ids(jnp.clip(slot, 0, pages_per_seq - 1))
    real = in_table & (page >= 0) & (page < num_pages)
    row = jnp.clip(page, 0, num_pages - 1) * page_size + k_pos % page_size
    return row, real

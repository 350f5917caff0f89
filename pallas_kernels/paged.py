"""What every paged-attention implementation agrees on: which keys a query sees.

A sequence of ``kv_len`` tokens lives in pages of ``page_size`` tokens listed in its
row of the page table; its ``q_len`` queries are its last tokens, so query ``t`` sits
at position ``kv_len - q_len + t`` (causal masks align bottom-right). The functions
here are plain jnp on arrays of positions, so the XLA reference and the kernels
evaluate the same expressions.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax.numpy as jnp
from jax import lax

from pallas_kernels.tile_classes import COMPUTED, FULL

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

    def key_range(self, kv_len: Array, first_t: Array, last_t: Array,
                  table_tokens: int) -> tuple[Array, Array]:
        """``[lo, hi)``: the only keys queries ``first_t..last_t`` may see, for kernels
        that skip the tiles outside it. None lies past the table's ``table_tokens``: a
        length past them (garbage under ``jit``) keeps the queries at their positions
        but walks no further, however large."""
        lo, hi = self._key_bounds(kv_len, first_t, last_t)
        hi = jnp.minimum(jnp.maximum(hi, lo), table_tokens)
        return jnp.minimum(lo, hi), hi

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


class WalkSteps(NamedTuple):
    """One q-block's walk over kv-blocks ``[begin, end)``: first the FULL ones, ``[full_begin,
    full_end)`` in order, then the others (COMPUTED) in order."""

    begin: Any
    full_begin: Any
    full_end: Any
    end: Any

    @property
    def count(self) -> Any:
        return self.end - self.begin

    @property
    def num_full(self) -> Any:
        return self.full_end - self.full_begin

    def index(self, step: Any) -> Any:
        """The kv-block of walk step ``step`` (``0 <= step < count``)."""
        before = self.full_begin - self.begin
        return jnp.where(step < self.num_full, self.full_begin + step,
                         jnp.where(step < self.num_full + before,
                                   self.begin + step - self.num_full,
                                   self.full_end + step - self.num_full - before))

    def flags(self, step: Any) -> Any:
        return jnp.where(step < self.num_full, FULL, COMPUTED)


@dataclasses.dataclass(frozen=True)
class PagedWalk:
    """The kv-blocks each q-block of a paged call walks, in closed form from its
    sequence's length: a kernel evaluates it on scalars per CTA, instead of reading
    walks an XLA kernel built before it (one launch less around a decoding step).

    Packed row ``r`` of a q-block (``block_q`` rows) is query ``r // group`` of the
    ``rows`` = q_len * group. A q-block walks the kv-blocks of its queries' key range
    (`PagedScores.key_range`); those inside the range every one of its queries sees
    (`PagedScores.shared_key_range`) are FULL, unless the sequence uses a page id
    outside the cache (``pages_real`` 0, `walk_seeds`): then every tile is COMPUTED, so
    that those pages' keys are masked. No walk passes the table's ``table_tokens`` keys
    (with a length past them, garbage under ``jit``, the queries keep their positions).
    """

    scores: PagedScores
    group: int
    rows: int
    block_q: int
    block_kv: int
    table_tokens: int

    @property
    def num_kv_blocks(self) -> int:
        return -(-self.table_tokens // self.block_kv)

    def steps(self, kv_len: Any, pages_real: Any, q_block: Any) -> WalkSteps:
        """The walk of ``q_block`` for a sequence of ``kv_len`` tokens (broadcasting;
        integer divisions of non-negative values only, which a kernel's scalars have)."""
        first_row = q_block * self.block_q
        first_t = lax.div(first_row, self.group)
        last_t = lax.div(jnp.minimum(first_row + self.block_q, self.rows) - 1, self.group)
        lo, hi = self.scores.key_range(kv_len, first_t, last_t, self.table_tokens)
        begin = lax.div(lo, self.block_kv)
        end = jnp.where(hi > lo, lax.div(hi + self.block_kv - 1, self.block_kv), begin)
        shared_lo, shared_hi = self.scores.shared_key_range(kv_len, first_t, last_t)
        shared_hi = jnp.minimum(shared_hi, self.table_tokens)
        # A negative shared_hi (queries before the first key) clips to full_begin either way.
        full_begin = jnp.clip(lax.div(shared_lo + self.block_kv - 1, self.block_kv), begin, end)
        full_end = jnp.where(pages_real != 0,
                             jnp.clip(lax.div(shared_hi, self.block_kv), full_begin, end),
                             full_begin)
        return WalkSteps(begin, full_begin, full_end, end)


def walk_seeds(kv_lens: Array, page_table: Array, *, num_pages: int, page_size: int,
               width: int) -> Array:
    """``[batch, width]`` int32: per sequence its length, then 1 when every page id it
    uses (of its first ``kv_lens`` tokens) lies in the cache, else 0 (`PagedWalk.steps`'
    ``pages_real``), then zeros. One reduction over the table (the minimum of each lane):
    XLA computes it in one kernel, the line a kernel loads as it is."""
    slots = page_table.shape[1]
    in_use = (jnp.arange(slots) * page_size)[None, :] < kv_lens[:, None]
    real = ((page_table >= 0) & (page_table < num_pages)) | ~in_use
    lane = jnp.arange(width)[None, None, :]
    lanes = jnp.where(lane == 0, kv_lens.astype(jnp.int32)[:, None, None],
                      jnp.where(lane == 1, real.astype(jnp.int32)[:, :, None], 0))
    return lanes.min(axis=1)


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

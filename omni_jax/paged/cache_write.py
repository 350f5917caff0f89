"""Appending tokens to a paged KV cache: one scatter of the new rows, not a cache copy."""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp

from omni_jax.paged import validation

Array = Any


def paged_cache_write(k_pages: Array, v_pages: Array, page_table: Array, kv_lens: Array,
                      k_new: Array, v_new: Array) -> tuple[Array, Array]:
    """Writes ``k_new, v_new [batch, n, kv_heads, head_dim]`` after each sequence's
    ``kv_lens[b]`` tokens, into the pages its ``page_table`` row lists.

    Returns the updated ``(k_pages, v_pages)``; the caller advances ``kv_lens`` by n.
    Under ``jax.jit`` with the pages donated (``donate_argnums``) XLA updates them in
    place. Tokens that would land past the table's pages or on a page id outside the
    cache (a free slot's -1) are dropped; outside ``jit`` that raises instead.
    """
    page_table, kv_lens = validation.check_cache(k_pages, v_pages, page_table, kv_lens)
    batch = page_table.shape[0]
    validation.check_new_tokens(k_new, v_new, k_pages, v_pages, batch)
    num_pages, page_size = k_pages.shape[:2]
    num_new, pages_per_seq = k_new.shape[1], page_table.shape[1]
    validation.check_lengths(page_table, kv_lens, num_pages=num_pages, page_size=page_size,
                             appended=num_new)
    if not (batch and num_new and pages_per_seq and num_pages):
        return k_pages, v_pages
    pos = kv_lens[:, None] + jnp.arange(num_new, dtype=jnp.int32)  # [B, n]
    slot = pos // page_size
    page = jnp.take_along_axis(page_table, jnp.clip(slot, 0, pages_per_seq - 1), axis=1)
    real = (pos >= 0) & (slot < pages_per_seq) & (page >= 0) & (page < num_pages)
    # An index past the cache makes the scatter drop that token.
    page = jnp.where(real, page, num_pages)
    offset = pos % page_size
    return (k_pages.at[page, offset].set(k_new, mode="drop"),
            v_pages.at[page, offset].set(v_new, mode="drop"))

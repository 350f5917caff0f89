"""The reference paged attention in plain XLA: a walk over chunks of each table's pages.

Each step gathers ``CHUNK_TOKENS`` tokens' worth of pages per sequence (by the page
table, ids clamped into the cache and the keys of bad ids masked) and folds them into
an online softmax, so memory grows with the chunk, not with the cache. The walk stops
after the longest sequence's last chunk. Runs anywhere; float64 inputs compute in
float64, others in float32.
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
from jax import lax

from pallas_kernels.paged import PagedScores, page_rows

Array = Any

# Tokens of each sequence gathered per step (whole pages, at least one).
CHUNK_TOKENS = 256


def paged_attention_xla(q: Array, k_pages: Array, v_pages: Array, page_table: Array,
                        kv_lens: Array, scores: PagedScores) -> tuple[Array, Array]:
    """(out ``[B, Sq, Hq, Dv]`` in q's dtype, lse ``[B, Hq, Sq]``) without sinks."""
    batch, q_len, num_heads, head_dim = q.shape
    num_pages, page_size, num_kv_heads, _ = k_pages.shape
    head_dim_v = v_pages.shape[-1]
    pages_per_seq = page_table.shape[1]
    group = num_heads // num_kv_heads
    compute = jnp.promote_types(q.dtype, jnp.float32)
    chunk_pages = max(1, min(pages_per_seq, CHUNK_TOKENS // page_size))
    chunk = chunk_pages * page_size
    num_chunks = -(-pages_per_seq // chunk_pages)

    grouped_q = q.reshape(batch, q_len, num_kv_heads, group, head_dim).astype(compute)
    q_pos = scores.query_position(kv_lens[:, None], jnp.arange(q_len))  # [B, Sq]
    flat_k = k_pages.reshape(num_pages * page_size, num_kv_heads, head_dim)
    flat_v = v_pages.reshape(num_pages * page_size, num_kv_heads, head_dim_v)

    def step(c, carry):
        row_max, row_sum, acc = carry
        k_pos = c * chunk + jnp.arange(chunk)
        rows, real = page_rows(
            k_pos[None, :], page_size=page_size, num_pages=num_pages,
            pages_per_seq=pages_per_seq,
            load_ids=lambda slots: jnp.take_along_axis(
                page_table, jnp.broadcast_to(slots, (batch, chunk)), axis=1))
        k, v = flat_k[rows].astype(compute), flat_v[rows].astype(compute)  # [B, C, Hkv, D]
        s = scores.scores(jnp.einsum("bqhgd,bkhd->bhgqk", grouped_q, k,
                                     precision=lax.Precision.HIGHEST))
        seen = real[:, None, :] & scores.visible(q_pos[:, :, None], k_pos[None, None, :],
                                                  kv_lens[:, None, None])
        s = jnp.where(seen[:, None, None], s, -jnp.inf)
        new_max = jnp.maximum(row_max, s.max(axis=-1))
        # Rows with nothing visible yet keep max -inf: shift by 0 so exp gives 0, not NaN.
        shift = jnp.where(new_max == -jnp.inf, 0.0, new_max)
        p = jnp.exp(s - shift[..., None])
        alpha = jnp.exp(row_max - shift)
        acc = acc * alpha[..., None] + jnp.einsum("bhgqk,bkhd->bhgqd", p, v,
                                                  precision=lax.Precision.HIGHEST)
        return new_max, row_sum * alpha + p.sum(axis=-1), acc

    stats = (batch, num_kv_heads, group, q_len)
    init = (jnp.full(stats, -jnp.inf, compute), jnp.zeros(stats, compute),
            jnp.zeros((*stats, head_dim_v), compute))
    needed = jnp.clip(-(-jnp.max(kv_lens) // chunk), 0, num_chunks)
    row_max, row_sum, acc = lax.fori_loop(0, needed, step, init)

    seen = row_sum > 0
    safe_sum = jnp.where(seen, row_sum, 1.0)
    lse = jnp.where(seen, row_max + jnp.log(safe_sum), -jnp.inf)
    out = acc / safe_sum[..., None]
    out = out.transpose(0, 3, 1, 2, 4).reshape(batch, q_len, num_heads, head_dim_v)
    return out.astype(q.dtype), lse.reshape(batch, num_heads, q_len)

"""Random paged caches and the float64 dense attention they stand for."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from tests.reference import reference_attention


@dataclasses.dataclass
class PagedCase:
    """A random batch over a shared paged cache: pages shuffled, tables ragged."""

    q: jax.Array
    k_pages: jax.Array
    v_pages: jax.Array
    page_table: jax.Array
    kv_lens: jax.Array


def random_case(seed: int, *, kv_lens, q_len=1, heads=4, kv_heads=2, head_dim=32,
                head_dim_v=None, page_size=16, pages_per_seq=None, spare_pages=3,
                dtype=jnp.float32, own_every_slot=False) -> PagedCase:
    """Sequences of ``kv_lens`` tokens on pages in random order; ``spare_pages`` pages
    belong to nobody. Table slots past a sequence's tokens hold random ids (they must be
    ignored), or with ``own_every_slot`` pages of their own (room to append)."""
    rng = np.random.default_rng(seed)
    kv_lens = np.asarray(kv_lens, np.int32)
    batch = len(kv_lens)
    needed = -(-kv_lens // page_size)
    pages_per_seq = pages_per_seq or max(1, int(needed.max()))
    if own_every_slot:
        needed = np.full(batch, pages_per_seq)
    num_pages = int(needed.sum()) + spare_pages
    order = rng.permutation(num_pages)
    table = rng.integers(0, num_pages, (batch, pages_per_seq), dtype=np.int32)
    start = 0
    for b, n in enumerate(needed):
        table[b, :n] = order[start:start + n]
        start += n
    keys = jax.random.split(jax.random.key(seed), 3)
    head_dim_v = head_dim_v or head_dim
    return PagedCase(
        q=jax.random.normal(keys[0], (batch, q_len, heads, head_dim), dtype),
        k_pages=jax.random.normal(keys[1], (num_pages, page_size, kv_heads, head_dim), dtype),
        v_pages=jax.random.normal(keys[2], (num_pages, page_size, kv_heads, head_dim_v), dtype),
        page_table=jnp.asarray(table), kv_lens=jnp.asarray(kv_lens))


def dense_paged_reference(case: PagedCase, *, is_causal=True, window=None, softcap=None,
                          sinks=None, scale=None):
    """(out, lse) in float64 of the case's queries over its cache gathered contiguous.
    Call inside ``jax.enable_x64(True)``."""
    table = np.asarray(case.page_table)
    lens = np.asarray(case.kv_lens)
    batch, q_len = case.q.shape[:2]
    k, v = (np.asarray(p, np.float64)[table].reshape(batch, -1, *p.shape[2:])
            for p in (case.k_pages, case.v_pages))
    q_pos = lens[:, None, None] - q_len + np.arange(q_len)[None, :, None]  # [B, Sq, 1]
    k_pos = np.arange(k.shape[1])[None, None, :]
    visible = np.broadcast_to(k_pos < lens[:, None, None], (batch, q_len, k.shape[1])).copy()
    if is_causal:
        visible &= k_pos <= q_pos
    if window is not None:
        visible &= (k_pos >= q_pos - window[0]) & (k_pos <= q_pos + window[1])
    return reference_attention(case.q, k, v, visible[:, None], scale=scale, softcap=softcap,
                               sinks=sinks)

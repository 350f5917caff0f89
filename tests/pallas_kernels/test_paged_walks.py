"""`pallas_kernels.paged.PagedWalk` and `walk_seeds`, the walks the paged Mosaic kernel
computes per CTA, evaluated here on arrays against every tile's visibility in numpy."""

import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pallas_kernels.paged import PagedScores, PagedWalk, walk_seeds

BLOCK_Q = 128  # The Mosaic forward's q tile.

# name: (kv_lens, q_len, group, page_size, pages_per_seq, block_kv, is_causal, window).
WALK_CASES = {
    "decode_gqa": ([0, 1, 700, 1024, 333], 1, 4, 16, 64, 128, True, None),
    "decode_ragged_table": ([5, 200, 999], 1, 8, 16, 63, 64, True, None),
    "prefill_chunk": ([300, 900, 2048], 40, 4, 64, 32, 128, True, None),
    "window": ([1000, 90, 2000], 33, 1, 32, 64, 64, True, (300, 0)),
    "not_causal_window": ([1000, 700], 50, 2, 64, 16, 128, False, (200, 100)),
    "not_causal": ([0, 130, 511], 3, 4, 128, 4, 128, False, None),
}


def _tile_visibility(lens, table, num_pages, scores, *, group, rows, page_size, block_kv,
                     num_q_blocks, num_kv_blocks):
    """(any, all) keys visible per (sequence, packed q-block, kv-block) tile, in numpy
    from `PagedScores.visible` and the page ids: what a walk must cover and may call FULL."""
    padded_rows, padded_keys = num_q_blocks * BLOCK_Q, num_kv_blocks * block_kv
    q_pos = np.asarray(scores.query_position(np.asarray(lens)[:, None],
                                             np.arange(rows)[None] // group))  # [B, R]
    k_pos = np.arange(padded_keys)
    slot = np.minimum(k_pos // page_size, table.shape[1] - 1)
    real = (table[:, slot] >= 0) & (table[:, slot] < num_pages) & (
        k_pos < table.shape[1] * page_size)
    seen = np.asarray(scores.visible(jnp.asarray(q_pos[:, :, None]), k_pos[None, None, :],
                                     jnp.asarray(lens)[:, None, None])) & real[:, None, :]
    tiles = np.zeros((len(lens), padded_rows, padded_keys), bool)
    valid = np.zeros_like(tiles)
    tiles[:, :rows] = seen
    valid[:, :rows] = True
    shape = (len(lens), num_q_blocks, BLOCK_Q, num_kv_blocks, block_kv)
    tiles, valid = tiles.reshape(shape), valid.reshape(shape)
    return tiles.any(axis=(2, 4)), (tiles | ~valid).all(axis=(2, 4))


def _check_walks(lens, table, num_pages, scores, *, group, page_size, block_kv):
    """Every q-block's walk holds exactly the tiles with a visible key, FULL ones (all
    keys visible) first; a sequence that uses a page id outside the cache walks them all
    COMPUTED (its bad pages' keys are masked)."""
    rows = scores.q_len * group
    walk = PagedWalk(scores, group=group, rows=rows, block_q=BLOCK_Q, block_kv=block_kv,
                     table_tokens=table.shape[1] * page_size)
    num_q_blocks = -(-rows // BLOCK_Q)
    seeds = walk_seeds(jnp.asarray(lens), jnp.asarray(table), num_pages=num_pages,
                       page_size=page_size, width=8)
    np.testing.assert_array_equal(np.asarray(seeds[:, 0]), lens)
    assert not np.asarray(seeds[:, 2:]).any()
    in_use = np.arange(table.shape[1])[None] * page_size < lens[:, None]
    has_bad = (((table < 0) | (table >= num_pages)) & in_use).any(axis=1)
    np.testing.assert_array_equal(np.asarray(seeds[:, 1]), ~has_bad)
    any_seen, all_seen = _tile_visibility(
        lens, table, num_pages, scores, group=group, rows=rows, page_size=page_size,
        block_kv=block_kv, num_q_blocks=num_q_blocks, num_kv_blocks=walk.num_kv_blocks)
    for b in range(len(lens)):
        for i in range(num_q_blocks):
            steps = walk.steps(seeds[b, 0], seeds[b, 1], i)
            positions = jnp.arange(int(steps.count))
            blocks = np.asarray(steps.index(positions))
            full = blocks[:int(steps.num_full)]
            assert len(set(blocks)) == len(blocks)
            assert (np.asarray(steps.flags(positions))
                    == np.where(np.arange(len(blocks)) < len(full), 0, 1)).all()
            assert set(np.flatnonzero(any_seen[b, i])) <= set(blocks)
            if has_bad[b]:
                assert len(full) == 0
                continue
            assert set(blocks) == set(np.flatnonzero(any_seen[b, i]))
            assert set(full) == set(np.flatnonzero(all_seen[b, i] & any_seen[b, i]))


@pytest.mark.parametrize("bad_ids", [False, True])
@pytest.mark.parametrize("name", WALK_CASES)
def test_walks_cover_the_visible_tiles(name, bad_ids, seed):
    kv_lens, q_len, group, page_size, pages_per_seq, block_kv, causal, window = WALK_CASES[name]
    rng = np.random.default_rng(seed)
    num_pages = 4 * pages_per_seq
    table = rng.integers(0, num_pages, (len(kv_lens), pages_per_seq), dtype=np.int32)
    lens = np.asarray(kv_lens, np.int32)
    if bad_ids:  # the first page of the longest sequence, the last of the last one
        table[np.argmax(lens), 0], table[-1, (lens[-1] - 1) // page_size] = num_pages, -1
    scores = PagedScores(q_len=q_len, is_causal=causal, window=window, softcap=None,
                         scale=1.0)
    _check_walks(lens, table, num_pages, scores, group=group, page_size=page_size,
                 block_kv=block_kv)


@settings(max_examples=25, deadline=None)
@given(data=st.data(), q_len=st.integers(1, 300), group=st.sampled_from([1, 2, 4, 8]),
       page_size=st.sampled_from([16, 32, 64, 128, 256]), block_kv=st.sampled_from([64, 128]),
       causal=st.booleans(),
       window=st.none() | st.tuples(st.integers(0, 3000), st.integers(0, 3000)))
def test_walks_cover_the_visible_tiles_for_any_call(data, q_len, group, page_size, block_kv,
                                                    causal, window):
    """Random lengths (0, shorter than q_len, past the table too), windows of every
    width, and page ids anywhere in or outside the cache."""
    pages_per_seq = data.draw(st.integers(1, 2048 // page_size + 1), "pages_per_seq")
    num_pages = data.draw(st.integers(1, 64), "num_pages")
    batch = data.draw(st.integers(1, 3), "batch")
    capacity = pages_per_seq * page_size
    lens = np.asarray(data.draw(st.lists(st.integers(0, capacity + 100), min_size=batch,
                                         max_size=batch), "kv_lens"), np.int32)
    table = np.asarray(data.draw(st.lists(
        st.lists(st.integers(-2, num_pages + 1), min_size=pages_per_seq,
                 max_size=pages_per_seq), min_size=batch, max_size=batch), "table"), np.int32)
    scores = PagedScores(q_len=q_len, is_causal=causal, window=window, softcap=None,
                         scale=1.0)
    _check_walks(lens, table, num_pages, scores, group=group, page_size=page_size,
                 block_kv=block_kv)

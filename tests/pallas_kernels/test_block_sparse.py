"""The kernels' view of a BlockMask: walks list FULL tiles first, nothing lost or added;
the ordered dQ's add turns; walk statistics from concrete arrays, or the hint of traced
ones."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from omni_jax.masks import FULL, BlockMask
from pallas_kernels.block_sparse import (
    WalkStatistics,
    kernel_mask,
    packed_walk,
    rotated_add_turns,
    walk_offsets,
    walk_statistics,
)


@st.composite
def random_tile_flags(draw):
    """Dense tile flags [Bm, Hm, nq, nkv] in {MASKED, FULL, COMPUTED, PARTIAL, both}."""
    shape = (draw(st.integers(1, 2)), draw(st.integers(1, 2)), draw(st.integers(1, 5)),
             draw(st.integers(1, 6)))
    seed = draw(st.integers(0, 2**31 - 1))
    return np.random.default_rng(seed).choice([-1, 0, 1, 2, 3], size=shape).astype(np.int32)


def _check_walk(count, num_full, indices, flags, ids, original):
    """One orientation: FULL tiles first, the same active tiles, the same padding."""
    count, num_full = np.asarray(count), np.asarray(num_full)
    indices, flags, ids = map(np.asarray, (indices, flags, ids))
    o_indices, o_flags, o_ids = map(np.asarray, original)
    for pos in np.ndindex(count.shape):
        n, f = count[pos], num_full[pos]
        assert f == np.sum(o_flags[pos][:n] == FULL)
        assert np.all(flags[pos][:f] == FULL) and np.all(flags[pos][f:n] != FULL)
        reordered = sorted(zip(indices[pos][:n], flags[pos][:n], ids[pos][:n], strict=True))
        listed = sorted(zip(o_indices[pos][:n], o_flags[pos][:n], o_ids[pos][:n], strict=True))
        assert reordered == listed
        np.testing.assert_array_equal(indices[pos][n:], o_indices[pos][n:])


@settings(max_examples=25, deadline=None)
@given(random_tile_flags())
def test_walks_list_full_tiles_first(tile_flags):
    nq, nkv = tile_flags.shape[2:]
    ids = np.where(tile_flags >= 2, 0, -1).astype(np.int32)
    mask = BlockMask.from_tile_flags(tile_flags, ids, np.ones((1, 16, 16), bool),
                                     q_len=16 * nq, kv_len=16 * nkv, block_size=(16, 16))
    kmask, _ = kernel_mask(mask)
    _check_walk(mask.kv_num_blocks, kmask.kv_num_full, kmask.kv_indices, kmask.kv_tile_flags,
                kmask.kv_partial_ids,
                (mask.kv_indices, mask.kv_tile_flags, mask.kv_partial_ids))
    _check_walk(mask.q_num_blocks, kmask.q_num_full, kmask.q_indices, kmask.q_tile_flags,
                kmask.q_partial_ids, (mask.q_indices, mask.q_tile_flags, mask.q_partial_ids))
    _check_packed(kmask, "kv")
    _check_packed(kmask, "q")


@settings(max_examples=25, deadline=None)
@given(random_tile_flags(), st.booleans(), st.integers(1, 4))
def test_add_turns_follow_the_rotated_walks(tile_flags, all_full, group_size):
    """Kv-block j walks its n FULL tiles from its (j mod n)-th on; each q-block's adds
    from a group of ``group_size`` consecutive kv-blocks take the turns 0, 1, ... in the
    order the walks reach it (by step, then kv-block), the last stored as -turn - 1; 0
    past the walk."""
    if all_full:  # Walks of FULL tiles only, the ordered dQ's (dense ones among them).
        tile_flags = np.where(tile_flags > 0, FULL, 0).astype(tile_flags.dtype)
    nq, nkv = tile_flags.shape[2:]
    ids = np.where(tile_flags >= 2, 0, -1).astype(np.int32)
    mask = BlockMask.from_tile_flags(tile_flags, ids, np.ones((1, 16, 16), bool),
                                     q_len=16 * nq, kv_len=16 * nkv, block_size=(16, 16))
    kmask, _ = kernel_mask(mask)
    turns = np.asarray(rotated_add_turns(kmask, group_size))
    num_full, indices = np.asarray(kmask.q_num_full), np.asarray(kmask.q_indices)
    assert turns.shape == indices.shape and turns.dtype == np.int32
    for b, h in np.ndindex(tile_flags.shape[:2]):
        adds = {}  # (group, q-block) -> [(step reached, kv-block, stored turn)]
        for kv in range(nkv):
            n = num_full[b, h, kv]
            assert np.all(turns[b, h, kv, n:] == 0)
            for p in range(n):
                step = (p - kv % n) % n
                adds.setdefault((kv // group_size, indices[b, h, kv, p]), []).append(
                    (step, kv, turns[b, h, kv, p]))
        for key, group_adds in adds.items():
            stored = [turn for *_, turn in sorted(group_adds)]
            expected = list(range(len(stored) - 1)) + [-len(stored)]
            assert stored == expected, (key, group_adds)


def _check_packed(kmask, over):
    """The packed row holds every array of the walk where `walk_offsets` says."""
    packed = np.asarray(packed_walk(kmask, over))
    count, num_full, indices, flags, ids = (
        np.asarray(getattr(kmask, f"{over}_{name}"))
        for name in ("num_blocks", "num_full", "indices", "tile_flags", "partial_ids"))
    m = indices.shape[-1]
    assert packed.shape == (*count.shape, 2 + 3 * m) and packed.dtype == np.int32
    index_at, flags_at, ids_at = walk_offsets(m)
    np.testing.assert_array_equal(packed[..., 0], count)
    np.testing.assert_array_equal(packed[..., 1], num_full)
    np.testing.assert_array_equal(packed[..., index_at:index_at + m], indices)
    np.testing.assert_array_equal(packed[..., flags_at:flags_at + m], flags)
    np.testing.assert_array_equal(packed[..., ids_at:ids_at + m], ids)


@settings(max_examples=15, deadline=None)
@given(random_tile_flags(), st.integers(0, 15))
def test_walk_hint_of_tile_flags_equals_the_kernels_statistics(tile_flags, kv_short):
    """`WalkStatistics.of_tile_flags` (how hints are computed) against the walks' own
    counts; a ragged kv tail (``kv_short``) makes its FULL tiles COMPUTED."""
    nq, nkv = tile_flags.shape[2:]
    mask = BlockMask.from_tile_flags(tile_flags, q_len=16 * nq, kv_len=16 * nkv - kv_short,
                                     block_size=(16, 16))
    hint = mask.walk_statistics()
    concrete = walk_statistics(kernel_mask(mask)[0])
    np.testing.assert_allclose(
        (hint.mean_kv_blocks, hint.mean_full_q_blocks),
        (concrete.mean_kv_blocks, concrete.mean_full_q_blocks), rtol=1e-12)
    np.testing.assert_allclose(concrete.mean_kv_blocks, np.mean(mask.kv_num_blocks))

    seen = []
    traced = jax.jit(lambda mask: seen.append(walk_statistics(kernel_mask(mask)[0])))
    traced(mask.with_walk_hint(hint))
    traced(mask)
    assert seen == [hint, None]
    # Concrete arrays win over a hint that disagrees with them.
    wrong = WalkStatistics(hint.mean_kv_blocks + 1, hint.mean_full_q_blocks)
    assert walk_statistics(kernel_mask(mask.with_walk_hint(wrong))[0]) == concrete


@pytest.mark.parametrize(("fields", "message"), [
    ((-1.0, 0.0), "mean_kv_blocks must be a finite number >= 0, got -1.0"),
    ((1.0, float("nan")), "mean_full_q_blocks must be a finite number >= 0, got nan"),
    ((1.0, "2"), "mean_full_q_blocks must be a finite number >= 0, got '2'"),
])
def test_walk_statistics_reject_bad_values(fields, message):
    with pytest.raises(ValueError, match=message):
        WalkStatistics(*fields)

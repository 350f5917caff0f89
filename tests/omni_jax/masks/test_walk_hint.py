"""`BlockMask.walk_hint`: static aux data that traced masks carry into the kernels'
config choice, kept by mask methods only where it stays exact."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import omni_jax
from omni_jax.masks import BlockMask, WalkStatistics
from omni_jax.masks.regroup import regroup


def _documents_mask(seed: int, q_len: int, kv_len: int, block_size=(16, 16)) -> BlockMask:
    rng = np.random.default_rng(seed)
    ids = jnp.asarray(np.sort(rng.integers(0, 4, (2, max(q_len, kv_len))), axis=1), jnp.int32)
    mask_mod = omni_jax.and_masks(omni_jax.causal_mask,
                                  omni_jax.document_mask(ids[:, :q_len], ids[:, :kv_len]))
    return omni_jax.create_block_mask(mask_mod, 2, None, q_len, kv_len, block_size)


def test_hint_is_static_aux_data_through_jit(seed):
    mask = _documents_mask(seed, 64, 80)
    hint = mask.walk_statistics()
    seen = []
    traced = jax.jit(lambda mask: seen.append(mask.walk_hint) or mask.kv_num_blocks.sum())
    traced(mask.with_walk_hint(hint))
    traced(mask.with_walk_hint(hint))  # the same key: no new trace
    traced(mask.with_walk_hint(WalkStatistics(1.0, 0.0)))  # another key: traced again
    traced(mask)
    assert seen == [hint, WalkStatistics(1.0, 0.0), None]
    leaves, treedef = jax.tree.flatten(mask.with_walk_hint(hint))
    assert jax.tree.unflatten(treedef, leaves).walk_hint == hint


@pytest.mark.parametrize(("q_len", "group", "kept"), [
    (64, 2, True),  # every q-block repeated group times
    (60, 2, True),  # ragged, but its last q-block still repeats twice (120 rows: 8 blocks)
    (36, 4, False),  # 144 rows: 9 blocks, the last q-block repeated once
])
def test_repeat_queries_keeps_the_hint_where_exact(q_len, group, kept, seed):
    mask = _documents_mask(seed, q_len, 72)
    repeated = mask.with_walk_hint(mask.walk_statistics()).repeat_queries(group)
    if not kept:
        assert repeated.walk_hint is None
        return
    got, want = repeated.walk_hint, repeated.walk_statistics()
    np.testing.assert_allclose((got.mean_kv_blocks, got.mean_full_q_blocks),
                               (want.mean_kv_blocks, want.mean_full_q_blocks), rtol=1e-12)


def test_masks_made_anew_drop_the_hint(seed):
    mask = _documents_mask(seed, 64, 64)
    hinted = mask.with_walk_hint(mask.walk_statistics())
    assert hinted.restrict(omni_jax.sliding_window_mask(8)).walk_hint is None
    assert regroup(hinted, (32, 32)).walk_hint is None


def test_bad_hints_and_traced_statistics_raise():
    mask = _documents_mask(0, 32, 32)
    with pytest.raises(ValueError, match="walk_hint must be None or a WalkStatistics, got tuple"):
        mask.with_walk_hint((1.0, 0.0))
    with pytest.raises(TypeError, match="must be concrete: this one is traced"):
        jax.jit(lambda mask: mask.walk_statistics() and 0)(mask)

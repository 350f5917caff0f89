"""`AtPositions`: a structured mask at given global positions (context parallelism)."""

import jax.numpy as jnp
import numpy as np
import pytest

from omni_jax.masks import BlockGrid, Causal, Chunked, SlidingWindow
from omni_jax.masks.mask_mods import AtPositions


@pytest.mark.parametrize("inner", [Causal(), SlidingWindow(5, 2), Chunked(6)],
                         ids=["causal", "window", "chunked"])
def test_tiles_are_classified_from_the_positions(inner, seed):
    """FULL tiles are all visible and empty ones all masked, element by element, for
    shuffled-in-blocks positions (as zigzag shards have them)."""
    rng = np.random.default_rng(seed)
    q_positions = jnp.asarray(np.r_[0:8, 40:48], jnp.int32)[None]
    kv_positions = jnp.asarray(rng.permutation(48)[:24], jnp.int32)[None]
    mask = AtPositions(inner, q_positions, kv_positions)
    grid = BlockGrid(16, 24, 4, 8)
    full, empty = (np.broadcast_to(x, (1, 1, 4, 3)) for x in mask.classify(grid))
    q_idx, kv_idx = np.meshgrid(np.arange(16), np.arange(24), indexing="ij")
    visible = np.asarray(mask(0, 0, q_idx, kv_idx))
    np.testing.assert_array_equal(
        visible, np.asarray(inner(0, 0, q_positions[0][:, None], kv_positions[0][None])))
    tiles = visible.reshape(4, 4, 3, 8).transpose(0, 2, 1, 3).reshape(4, 3, -1)
    assert np.all(tiles[full[0, 0]].all(axis=-1))
    assert not np.any(tiles[empty[0, 0]].any(axis=-1))

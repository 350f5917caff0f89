"""`zigzag` / `unzigzag` and the positions each layout gives a shard."""

import jax.numpy as jnp
import numpy as np
import pytest

from omni_jax.context_parallel import unzigzag, zigzag
from omni_jax.context_parallel.layout import shard_positions


@pytest.mark.parametrize("num_shards", [1, 2, 4])
def test_zigzag_shards_hold_chunks_i_and_mirror(num_shards):
    length = 4 * num_shards
    x = jnp.arange(length)[None, :, None]
    shards = np.split(np.asarray(zigzag(x, num_shards))[0, :, 0], num_shards)
    for i, shard in enumerate(shards):
        np.testing.assert_array_equal(shard, shard_positions("zigzag", i, num_shards, 4))
        np.testing.assert_array_equal(shard, np.r_[2 * i, 2 * i + 1, 2 * (2 * num_shards - 1 - i),
                                                   2 * (2 * num_shards - 1 - i) + 1])
    np.testing.assert_array_equal(unzigzag(zigzag(x, num_shards), num_shards), x)


def test_zigzag_along_another_axis():
    x = jnp.arange(24).reshape(2, 3, 4)
    np.testing.assert_array_equal(unzigzag(zigzag(x, 2, seq_axis=2), 2, seq_axis=2), x)


def test_zigzag_rejects_a_length_it_cannot_split():
    with pytest.raises(ValueError, match="multiple of 2 \\* axis_size = 4, got 6"):
        zigzag(jnp.zeros((1, 6)), 2)

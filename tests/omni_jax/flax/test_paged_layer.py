"""`Attention.decode_paged`: ragged sequences decoded on a shared paged cache give what
the layer gives each whole sequence at once."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tests.omni_jax.flax.test_layer import CASES, FEATURES, TOLERANCE, make_layer
from tests.reference import relative_error

PAGE_SIZE = 4


@pytest.mark.parametrize("window", [None, (5, 0)])
def test_ragged_paged_decoding_equals_whole_sequences(window, seed):
    layer = make_layer(CASES[1], seed=seed)
    x = jax.random.normal(jax.random.key(seed + 1), (2, 16, FEATURES))
    # Pages interleaved between the two sequences; 3 spare pages nobody uses.
    page_table = jnp.array([[0, 2, 4, 6], [7, 5, 3, 1]], jnp.int32)
    shape = (11, PAGE_SIZE, layer.num_kv_heads, layer.head_dim)
    k_pages = v_pages = jax.random.normal(jax.random.key(seed + 2), shape)  # never zeros
    step = nnx.jit(lambda layer, *args: layer.decode_paged(*args, local_window_size=window))

    def run(rows, tokens, lens):
        nonlocal k_pages, v_pages
        out, k_pages, v_pages = step(layer, tokens, k_pages, v_pages, page_table[rows],
                                     jnp.asarray(lens, jnp.int32))
        return out

    # Prompts of 7 and 3 tokens, prefilled alone; then both decode together.
    outs = [[run(slice(0, 1), x[:1, :7], [0])[0]], [run(slice(1, 2), x[1:, :3], [0])[0]]]
    lens = [7, 3]
    for size in (1, 1, 2, 1):
        tokens = jnp.stack([x[b, lens[b]:lens[b] + size] for b in range(2)])
        out = run(slice(0, 2), tokens, lens)
        for b in range(2):
            outs[b].append(out[b])
            lens[b] += size
    for b, length in enumerate(lens):
        full = layer(x[b:b + 1, :length], is_causal=True, local_window_size=window)[0]
        assert relative_error(jnp.concatenate(outs[b]), full) < TOLERANCE
    assert np.all(np.isfinite(np.asarray(k_pages)))

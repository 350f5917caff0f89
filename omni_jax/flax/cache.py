"""KV cache for autoregressive decoding, and the mask of a decode step.

The cache is preallocated ``[batch, max_len, kv_heads, head_dim]`` with one
current length per sequence. A decode step appends ``n`` tokens (one while
sampling; a whole prompt or a chunk of it while prefilling) at slots
``[index, index + n)``; query ``t`` of the step sees slots ``j <= index + t``.
That is a paged-attention call on the cache viewed as pages (`as_pages`): its
walks are built in closed form, where `CachedCausal`'s BlockMask (which packed
documents need) takes sorts and scatters at every step under ``jit``. Either way
unfilled cache blocks are skipped by every backend.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from omni_jax.masks import BlockGrid, BlockMask, MaskMod, create_block_mask
from omni_jax.masks.mask_mods import INT32_MAX
from omni_jax.paged.mosaic import PAGE_SIZES

Array = Any


@jax.tree_util.register_pytree_node_class
class CachedCausal(MaskMod):
    """Query t sees cache slots ``j`` with ``offsets[b] + t - window_left <= j <= offsets[b] + t``.

    ``offsets [batch]`` (int32) is the cache length before the step;
    ``window_left`` None means no sliding window.
    """

    def __init__(self, offsets: Array, window_left: int | None = None):
        self.offsets = offsets
        self.window_left = None if window_left is None else min(window_left, INT32_MAX)

    def tree_flatten(self):
        return (self.offsets,), self.window_left

    @classmethod
    def tree_unflatten(cls, aux, children):
        return cls(*children, aux)

    def predicate(self, q_idx, kv_idx):
        position = q_idx + self.offsets
        visible = kv_idx <= position
        if self.window_left is not None:
            visible &= position - kv_idx <= self.window_left  # a difference cannot overflow
        return visible

    def classify(self, grid: BlockGrid):
        q_start, q_end = grid.q_bounds()
        kv_start, kv_end = grid.kv_bounds()
        offsets = self.offsets[:, None, None, None]
        full = kv_end <= q_start + offsets
        empty = kv_start > q_end + offsets
        if self.window_left is not None:
            full &= kv_start >= q_end + offsets - self.window_left
            empty |= kv_end < q_start + offsets - self.window_left
        return full, empty

    def leaf_kinds(self):
        return ("batch",)


def decode_mask(index: Array, num_new: int, max_len: int,
                window_left: int | None = None) -> BlockMask:
    """The BlockMask of a step appending ``num_new`` tokens at per-sequence ``index [batch]``."""
    index = jnp.asarray(index, jnp.int32)
    return create_block_mask(CachedCausal(index, window_left), index.shape[0], None, num_new,
                             max_len)


def as_pages(keys: Array, values: Array, *, mosaic_only: bool = False,
             ) -> tuple[Array, Array, Array] | None:
    """``(k_pages, v_pages, page_table)``: contiguous caches ``[batch, max_len, ...]`` as
    `omni_jax.paged_attention` reads them, sequence ``b`` on pages ``b * n .. b * n + n
    - 1`` (views, no copy). Pages are of the largest size the Mosaic kernel tiles that
    divides ``max_len``, else one per sequence; None then with ``mosaic_only`` (a call
    forcing the Mosaic kernel, which takes the contiguous path instead)."""
    batch, max_len = keys.shape[:2]
    page = next((size for size in reversed(PAGE_SIZES) if max_len % size == 0), None)
    if page is None:
        if mosaic_only:
            return None
        page = max_len
    pages = max_len // page
    table = (jnp.arange(batch, dtype=jnp.int32)[:, None] * pages
             + jnp.arange(pages, dtype=jnp.int32)[None])
    view = lambda cache: cache.reshape(batch * pages, page, *cache.shape[2:])
    return view(keys), view(values), table


def write_cache(cache: Array, new: Array, slots: Array) -> Array:
    """``cache [b, max_len, ...]`` with ``new [b, n, ...]`` written at ``slots [b, n]``.

    Slots at or past ``max_len`` are dropped, leaving the cached tokens intact (a
    ``dynamic_update_slice`` would clamp its start and overwrite them).
    """
    rows = jnp.arange(cache.shape[0])[:, None]
    return cache.at[rows, slots].set(new.astype(cache.dtype), mode="drop")

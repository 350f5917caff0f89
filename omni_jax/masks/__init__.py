"""Attention masks: structured mask_mods, `BlockMask`, and `create_block_mask`."""

from omni_jax.masks.block_mask import COMPUTED, FULL, MASKED, PARTIAL, BlockMask, WalkStatistics
from omni_jax.masks.construct import create_block_mask
from omni_jax.masks.mask_mods import (
    And,
    BlockGrid,
    Causal,
    Chunked,
    Document,
    KeyPrefix,
    MaskMod,
    Or,
    SlidingWindow,
    and_masks,
    causal_mask,
    chunked_mask,
    document_mask,
    or_masks,
    prefix_lm_mask,
    sliding_window_mask,
)

__all__ = [
    "COMPUTED", "FULL", "MASKED", "PARTIAL", "And", "BlockGrid", "BlockMask", "Causal",
    "Chunked", "Document", "KeyPrefix", "MaskMod", "Or", "SlidingWindow", "and_masks",
    "causal_mask", "chunked_mask", "create_block_mask", "document_mask", "or_masks",
    "prefix_lm_mask", "sliding_window_mask", "WalkStatistics",
]

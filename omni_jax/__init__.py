"""omni-jax: exact, differentiable, block-sparse attention and fast matmul for JAX."""

from omni_jax import masks
from omni_jax.attention import attention
from omni_jax.masks import (
    BlockMask,
    and_masks,
    causal_mask,
    chunked_mask,
    create_block_mask,
    document_mask,
    or_masks,
    prefix_lm_mask,
    sliding_window_mask,
)
from omni_jax.matmul import matmul
from omni_jax.paged import paged_attention, paged_cache_write
from omni_jax.sparse_mla import sparse_mla_prefill

__version__ = "0.1.0"

__all__ = [
    "BlockMask", "and_masks", "attention", "causal_mask", "chunked_mask", "create_block_mask",
    "document_mask", "masks", "matmul", "or_masks", "paged_attention", "paged_cache_write",
    "prefix_lm_mask", "sliding_window_mask", "sparse_mla_prefill",
]

"""Flax integration: an nnx attention layer (with KV-cache decoding), a linen
wrapper, and ``attention_fn`` adapters for Flax's own attention modules."""

from omni_jax.flax import linen
from omni_jax.flax.adapters import attention_fn, block_mask_from_dense, make_attention_fn
from omni_jax.flax.cache import CachedCausal, decode_mask
from omni_jax.flax.nnx_attention import Attention, AxisNames
from omni_jax.flax.rope import apply_rope, segment_positions

__all__ = [
    "Attention", "AxisNames", "CachedCausal", "apply_rope", "attention_fn",
    "block_mask_from_dense", "decode_mask", "linen", "make_attention_fn", "segment_positions",
]

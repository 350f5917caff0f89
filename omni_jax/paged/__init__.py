"""Paged KV caches: attention over pages listed in a page table, and appending to them."""

from omni_jax.paged.api import paged_attention
from omni_jax.paged.cache_write import paged_cache_write

__all__ = ["paged_attention", "paged_cache_write"]

"""Sparse MLA prefill (DeepSeek sparse attention): SM90 FFI kernel and portable JAX path."""

from omni_jax.sparse_mla.api import sparse_mla_prefill

__all__ = ["sparse_mla_prefill"]

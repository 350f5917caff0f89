"""Sparse MLA prefill (DeepSeek sparse attention): SM90 FFI kernel and portable JAX path."""

from omni_jax.sparse_mla.api import kernel_platform_reason, sparse_mla_prefill

__all__ = ["kernel_platform_reason", "sparse_mla_prefill"]

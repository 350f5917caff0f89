"""``omni_jax.matmul``: a fused, differentiable, batchable GEMM (Mosaic, Triton, XLA paths)."""

from omni_jax.matmul.api import ACTIVATIONS, IMPLEMENTATIONS, matmul

__all__ = ["ACTIVATIONS", "IMPLEMENTATIONS", "matmul"]

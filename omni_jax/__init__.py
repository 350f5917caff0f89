"""omni-jax: exact, differentiable, block-sparse attention and fast matmul for JAX."""

__version__ = "0.1.0"

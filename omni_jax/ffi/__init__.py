"""XLA FFI CUDA library of omni-jax: building, loading and target registration.

``python -m omni_jax.ffi build`` builds the library ahead of time;
``python -m omni_jax.ffi info`` says whether it can be loaded here and why not.
"""

from omni_jax.ffi.build import BuildError
from omni_jax.ffi.library import LoadResult, load

__all__ = ["BuildError", "LoadResult", "load"]

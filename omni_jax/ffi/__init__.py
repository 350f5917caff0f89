"""XLA FFI CUDA library of omni-jax: building, loading and target registration.

``python -m omni_jax.ffi build`` builds the library ahead of time;
``python -m omni_jax.ffi info`` says, building nothing, whether its kernels can run here
and why not.
"""

from omni_jax.ffi.build import BuildError
from omni_jax.ffi.library import LoadResult, device_reason, load

__all__ = ["BuildError", "LoadResult", "device_reason", "load"]

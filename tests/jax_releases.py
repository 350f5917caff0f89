"""Skips for what the installed jax release cannot do on this machine (`pallas_kernels.compat`)."""

from __future__ import annotations

import pytest

from pallas_kernels import compat, runtime
from pallas_kernels.triton import tiles


def skip_unless_triton_lowers_here() -> None:
    """Lowering Triton kernels for CUDA needs a GPU from jax 0.11 on."""
    if not compat.triton_lowers_without_gpu() and runtime.gpu_compute_capability() is None:
        pytest.skip("this jax lowers Triton kernels for CUDA only on a GPU")


def triton_takes_head_dims(*dims: int | None) -> bool:
    """Whether the Triton kernels take these head dims under this jax (jax 0.12 rejects
    their masked reads past a head dim that is not a power of two)."""
    return compat.triton_slices_past_array_end() or all(
        dim is None or tiles.padded_head_dim(dim) == dim for dim in dims)


def skip_unless_triton_slices_past_array_end() -> None:
    if not compat.triton_slices_past_array_end():
        pytest.skip("this jax rejects slices past an array's end in Triton kernels")

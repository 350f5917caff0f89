"""Skips for what the installed jax release cannot do on this machine (`pallas_kernels.compat`)."""

from __future__ import annotations

import jax
import pytest

from pallas_kernels import compat, runtime


def skip_unless_triton_lowers_here() -> None:
    """Lowering Triton kernels for CUDA needs a GPU from jax 0.11 on."""
    if not compat.triton_lowers_without_gpu() and runtime.gpu_compute_capability() is None:
        pytest.skip("this jax lowers Triton kernels for CUDA only on a GPU")



def skip_unless_blackwell_interpreter() -> None:
    """The Mosaic-GPU interpreter runs Blackwell kernels (tcgen05 MMAs, tensor memory)
    from jax 0.11 (0.10's simulates neither); the sm100 GEMM's tests pass on 0.11.2 and
    0.12.0.1."""
    if jax.__version_info__ < (0, 11):
        pytest.skip(f"the Mosaic-GPU interpreter of jax {jax.__version__} does not simulate "
                    "tcgen05/TMEM (jax 0.11 and later do)")

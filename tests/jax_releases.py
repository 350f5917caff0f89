"""Skips for what the installed jax release cannot do on this machine (`pallas_kernels.compat`)."""

from __future__ import annotations

import pytest

from pallas_kernels import compat, runtime


def skip_unless_triton_lowers_here() -> None:
    """Lowering Triton kernels for CUDA needs a GPU from jax 0.11 on."""
    if not compat.triton_lowers_without_gpu() and runtime.gpu_compute_capability() is None:
        pytest.skip("this jax lowers Triton kernels for CUDA only on a GPU")



def skip_unless_blackwell_interpreter() -> None:
    """The sm100 kernels run interpreted from jax 0.12 on (`compat.interprets_blackwell`)."""
    if not compat.interprets_blackwell():
        pytest.skip("this jax's Mosaic-GPU interpreter cannot run the sm100 kernels (jax 0.12 "
                    "can)")

"""Where Pallas kernels run: compiled on a GPU, or interpreted on the CPU.

``OMNI_JAX_PALLAS_INTERPRET=1`` makes every Pallas backend run in interpret
mode, so the kernel test-suite runs unchanged on machines without a GPU:
Triton-lowered kernels get ``interpret=True``; Mosaic-GPU kernels get the
Mosaic-GPU interpreter, which simulates TMA, barriers and wgmma and reports
data races (a race is an error, so a racy kernel fails its tests).
"""

from __future__ import annotations

import functools
import os

import jax

INTERPRET_ENV_VAR = "OMNI_JAX_PALLAS_INTERPRET"


def interpret_requested() -> bool:
    """True when ``OMNI_JAX_PALLAS_INTERPRET`` asks for interpret mode."""
    return os.environ.get(INTERPRET_ENV_VAR, "").strip().lower() in ("1", "true", "yes", "on")


def mosaic_interpret_params():
    """Mosaic-GPU interpreter parameters (race detection on), or None when compiling."""
    if not interpret_requested():
        return None
    from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams

    return InterpretGPUParams(detect_races=True)


def reset_mosaic_interpreter() -> None:
    """Clears the Mosaic-GPU interpreter's state after a kernel raised inside it."""
    from jax._src.pallas.mosaic_gpu.interpret.interpret_pallas_call import (
        reset_gpu_interpret_mode_state,
    )

    reset_gpu_interpret_mode_state()


@functools.cache
def gpu_compute_capability() -> tuple[int, int] | None:
    """(major, minor) of the first CUDA device, or None when there is none."""
    try:
        devices = jax.devices("gpu")
    except RuntimeError:
        return None
    if not devices:
        return None
    capability = getattr(devices[0], "compute_capability", None)
    if capability is None:
        return None
    major, minor = str(capability).split(".")
    return int(major), int(minor)


def can_run_triton() -> bool:
    """Triton-lowered Pallas kernels run here (compiled on sm80+, or interpreted)."""
    if interpret_requested():
        return True
    capability = gpu_compute_capability()
    return capability is not None and capability >= (8, 0)


def can_run_mosaic_hopper() -> bool:
    """Mosaic-GPU Hopper kernels (wgmma, TMA) run here (on sm90, or interpreted)."""
    if interpret_requested():
        return True
    return gpu_compute_capability() == (9, 0)


def implementation_preference() -> tuple[str, ...]:
    """Backend names, best first, for ops with Mosaic, Triton and XLA implementations."""
    if jax.default_backend() != "gpu":
        return ("xla",)
    if can_run_mosaic_hopper():
        return ("mosaic", "triton", "xla")
    if can_run_triton():
        return ("triton", "xla")
    return ("xla",)

"""Where Pallas kernels run: compiled on a GPU, or interpreted on the CPU.

``OMNI_JAX_PALLAS_INTERPRET=1`` makes every Pallas backend run in interpret
mode, so the kernel test-suite runs unchanged on machines without a GPU:
Triton-lowered kernels get ``interpret=True``; Mosaic-GPU kernels get the
Mosaic-GPU interpreter, which simulates TMA, barriers and wgmma and reports
data races (a race is an error, so a racy kernel fails its tests).
``OMNI_JAX_PALLAS_INTERPRET=sm100`` interprets as a Blackwell GPU instead: the
Mosaic backend runs its sm100 kernels (tcgen05 MMAs, tensor memory; the
interpreter simulates them from jax 0.12) where ``=1`` runs the Hopper ones.
"""

from __future__ import annotations

import functools
import os
import warnings

import jax
from jax._src import xla_bridge

INTERPRET_ENV_VAR = "OMNI_JAX_PALLAS_INTERPRET"

# The Mosaic-GPU interpreter runs every simulated warpgroup as an XLA CPU computation
# that blocks on barriers. XLA's CPU thread pool has one thread per core unless the
# NPROC environment variable says more, so on a machine with few cores a
# warp-specialized kernel waits forever for a warpgroup that never gets a thread.
INTERPRETER_THREADS = 16


_INTERPRET_HOPPER = ("1", "true", "yes", "on", "sm90")
_INTERPRET_BLACKWELL = ("sm100",)


def _interpret_setting() -> str:
    return os.environ.get(INTERPRET_ENV_VAR, "").strip().lower()


def interpret_requested() -> bool:
    """True when ``OMNI_JAX_PALLAS_INTERPRET`` asks for interpret mode."""
    return _interpret_setting() in _INTERPRET_HOPPER + _INTERPRET_BLACKWELL


def interpreted_architecture() -> str | None:
    """The GPU the interpreter stands in for ("sm90" or "sm100"), None when compiling."""
    setting = _interpret_setting()
    if setting in _INTERPRET_BLACKWELL:
        return "sm100"
    return "sm90" if setting in _INTERPRET_HOPPER else None


def _interpreter_threads_short() -> bool:
    """XLA's CPU pool (NPROC, else one thread per core) is too small for the interpreter."""
    threads = os.environ.get("NPROC", "").strip()
    threads = int(threads) if threads.isdigit() else os.cpu_count() or 1
    return threads < INTERPRETER_THREADS


def request_interpreter_threads() -> None:
    """In interpret mode, asks XLA for enough CPU threads, while it still can (NPROC is read
    once, when JAX starts its CPU backend)."""
    if (interpret_requested() and "NPROC" not in os.environ and _interpreter_threads_short()
            and not xla_bridge.backends_are_initialized()):
        os.environ["NPROC"] = str(INTERPRETER_THREADS)


@functools.cache
def _warn_interpreter_threads() -> None:
    warnings.warn(
        f"the Mosaic-GPU interpreter may deadlock: XLA's CPU backend started with fewer than "
        f"{INTERPRETER_THREADS} threads. Set NPROC={INTERPRETER_THREADS} in the environment, "
        f"or import omni_jax with {INTERPRET_ENV_VAR}=1 set before JAX computes anything.",
        RuntimeWarning, stacklevel=3)


def mosaic_interpret_params():
    """Mosaic-GPU interpreter parameters (race detection on), or None when compiling."""
    if not interpret_requested():
        return None
    request_interpreter_threads()
    if _interpreter_threads_short():
        _warn_interpreter_threads()
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


# SMs of an H100 SXM or H200: what the split choices assume where no GPU says otherwise
# (interpret mode).
DEFAULT_NUM_SMS = 132


@functools.cache
def num_sms() -> int:
    """Streaming multiprocessors of the first CUDA device (`DEFAULT_NUM_SMS` without one)."""
    try:
        devices = jax.devices("gpu")
    except RuntimeError:
        return DEFAULT_NUM_SMS
    count = getattr(devices[0], "core_count", None) if devices else None
    return int(count) if count else DEFAULT_NUM_SMS


def can_run_triton() -> bool:
    """Triton-lowered Pallas kernels run here (compiled on sm80+, or interpreted)."""
    if interpret_requested():
        return True
    capability = gpu_compute_capability()
    return capability is not None and capability >= (8, 0)


def can_run_mosaic_hopper() -> bool:
    """Mosaic-GPU Hopper kernels (wgmma, TMA) run here (on sm90, or interpreted as sm90)."""
    if interpret_requested():
        return interpreted_architecture() == "sm90"
    return gpu_compute_capability() == (9, 0)


def can_run_mosaic_blackwell() -> bool:
    """Mosaic-GPU Blackwell kernels (tcgen05, tensor memory) run here: on a datacenter
    Blackwell (compute capability 10.x; sm120 has no tensor memory), or interpreted as
    sm100."""
    if interpret_requested():
        return interpreted_architecture() == "sm100"
    capability = gpu_compute_capability()
    return capability is not None and capability[0] == 10


def mosaic_architecture() -> str | None:
    """Which Mosaic-GPU kernels run here: "sm90", "sm100", or None."""
    if can_run_mosaic_hopper():
        return "sm90"
    return "sm100" if can_run_mosaic_blackwell() else None


def implementation_preference() -> tuple[str, ...]:
    """Backend names, best first, for ops with Mosaic, Triton and XLA implementations."""
    if jax.default_backend() != "gpu":
        return ("xla",)
    if mosaic_architecture() is not None:
        return ("mosaic", "triton", "xla")
    if can_run_triton():
        return ("triton", "xla")
    return ("xla",)


request_interpreter_threads()

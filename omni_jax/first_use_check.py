"""Kernels never executed on their architecture check themselves on first use.

Our Blackwell (sm100) kernels were verified only in JAX's Mosaic-GPU interpreter and by
lowering; no sm100 GPU was available to run them. On a real one, the first use of each
kernel configuration in a process runs it on a small problem beside the `xla` backend
(`verified`): a mismatch, NaN or an error logs a warning with what went wrong, and that
configuration is declined from then on, so dispatch routes it to the next backend.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
from collections.abc import Callable, Hashable
from typing import Any

import jax
import numpy as np

from pallas_kernels import runtime

logger = logging.getLogger(__name__)

# Relative (Frobenius) error a 16-bit kernel's output may show against the float32
# reference on the small check problems: about 4e-3 for outputs, 1e-2 for gradients.
TOLERANCE = 3e-2

_outcomes: dict[Hashable, str | None] = {}  # key -> None (passed) or why it failed
_checking: set[Hashable] = set()  # keys whose check is running (its own calls pass)
_lock = threading.RLock()


def unverified_hardware() -> bool:
    """Whether this process runs kernels on an architecture they were not executed on
    before: a datacenter Blackwell GPU (compute capability 10.x), not interpreted."""
    if runtime.interpret_requested():
        return False
    capability = runtime.gpu_compute_capability()
    return capability is not None and capability[0] == 10


def relative_error(got: Any, want: Any) -> float:
    """The largest relative error over matching leaves; NaN if an output is not finite."""
    worst = 0.0
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        if a.shape != b.shape:
            raise ValueError(f"the kernel's output has shape {a.shape}, the reference's "
                             f"{b.shape}")
        if not np.isfinite(a).all():
            return float("nan")
        worst = max(worst, float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30)))
    return worst


def verified(key: Hashable, what: str, kernel: Callable[[], Any],
             reference: Callable[[], Any], *, tolerance: float = TOLERANCE) -> str | None:
    """None when the configuration ``key`` is fit to use, else why not.

    Off unverified hardware every configuration passes untested. There, the first call
    for ``key`` runs ``kernel()`` and ``reference()`` (each computing the same small
    problem, the reference with the `xla` backend in float32) eagerly, even while a
    caller is being traced, and compares them; later calls return the remembered outcome.
    While a check runs, calls for its own key pass (the check's own kernel call
    dispatches through the same code).
    """
    if not unverified_hardware():
        return None
    with _lock:
        if key in _outcomes:
            return _outcomes[key]
        if key in _checking:
            return None
        _checking.add(key)
    try:
        outcome = _compare(what, kernel, reference, tolerance)
    finally:
        with _lock:
            _checking.discard(key)
    with _lock:
        _outcomes[key] = outcome
    if outcome is None:
        logger.info("%s: checked on first use against the xla backend: passed", what)
    else:
        logger.warning("%s: declined; routed to the next backend. %s", what, outcome)
    return outcome


def _compare(what: str, kernel: Callable[[], Any], reference: Callable[[], Any],
             tolerance: float) -> str | None:
    try:
        # Run now even while a caller is being traced: JAX's trace state is per thread,
        # so in a thread of its own the check executes instead of being staged out.
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            got, want = pool.submit(lambda: jax.block_until_ready(
                (jax.jit(kernel)(), jax.jit(reference)()))).result()
        error = relative_error(got, want)
    except Exception as failure:  # noqa: BLE001 - any failure declines the configuration
        return (f"its first-use check on this GPU raised {type(failure).__name__}: "
                f"{str(failure).strip()[:300]}")
    if not error <= tolerance:  # NaN fails too
        return (f"its first-use check on this GPU gave a relative error of {error:.3g} "
                f"against the xla backend (allowed {tolerance:g}) for {what}")
    return None


def reset() -> None:
    """Forgets every outcome (tests)."""
    with _lock:
        _outcomes.clear()
        _checking.clear()

"""Logging of the dispatch choices (which backend or implementation serves a call), and
the warning a much slower fallback gives.

Each distinct record once per process: an eager training loop plans every step,
and the same choice need not be repeated (JAX users often run with INFO on).
"""

from __future__ import annotations

import logging
import warnings

from pallas_kernels import runtime

_logged: set[tuple[str, int, str]] = set()
_warned: set[str] = set()


def warn_xla_on_a_gpu(what: str, call: str, declined: dict[str, str]) -> None:
    """`warn_slow_fallback` for ``what`` ("omni_jax.attention runs its backward on the XLA
    backend") on a GPU whose kernels ``declined`` the ``call`` (backend: reason); quiet
    off GPUs and under the Pallas interpreter, where XLA is the fast path."""
    if runtime.gpu_compute_capability() is None or runtime.interpret_requested():
        return
    reasons = "; ".join(f"not {name}: {reason}" for name, reason in declined.items())
    warn_slow_fallback(
        f"{what} on this GPU, many times slower than the kernels, for "
        f"{call}: {reasons}. Change what those reasons name to reach a kernel, or pass "
        f"implementation='xla' to choose XLA without this warning.")


def warn_slow_fallback(message: str) -> None:
    """A `UserWarning` with ``message`` (what runs instead, why, and the remedy), once
    per process: for fallbacks more than 2x slower than what the hardware supports."""
    if message in _warned:
        return
    _warned.add(message)
    warnings.warn(message, UserWarning, stacklevel=3)


def log_once(logger: logging.Logger, level: int, message: str, *args: object) -> None:
    """Logs ``message % args`` at ``level`` unless this logger already logged it there;
    formats nothing while ``level`` is off (callers sit on every eager call's path)."""
    if not logger.isEnabledFor(level):
        return
    key = (logger.name, level, message % args if args else message)
    if key in _logged:
        return
    _logged.add(key)
    logger.log(level, key[2])

"""Logging of the dispatch choices (which backend or implementation serves a call), and
the warning a much slower fallback gives.

Each distinct record once per process: an eager training loop plans every step,
and the same choice need not be repeated (JAX users often run with INFO on).
"""

from __future__ import annotations

import logging
import warnings

_logged: set[tuple[str, int, str]] = set()
_warned: set[str] = set()


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

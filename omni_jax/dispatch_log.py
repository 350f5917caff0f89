"""Logging of the dispatch choices (which backend or implementation serves a call).

Each distinct record once per process: an eager training loop plans every step,
and the same choice need not be repeated (JAX users often run with INFO on).
"""

from __future__ import annotations

import logging

_logged: set[tuple[str, int, str]] = set()


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

"""Logging of the dispatch choices (which backend or implementation serves a call).

Each distinct record once per process: an eager training loop plans every step,
and the same choice need not be repeated (JAX users often run with INFO on).
"""

from __future__ import annotations

import logging

_logged: set[tuple[str, int, str]] = set()


def log_once(logger: logging.Logger, level: int, message: str) -> None:
    """Logs ``message`` at ``level`` unless this logger already logged it there."""
    key = (logger.name, level, message)
    if key in _logged or not logger.isEnabledFor(level):
        return
    _logged.add(key)
    logger.log(level, message)

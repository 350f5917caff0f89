"""`log_once`: each distinct dispatch record once per process."""

import logging

from omni_jax import dispatch_log


def test_a_record_is_logged_once_per_level(caplog, monkeypatch):
    monkeypatch.setattr(dispatch_log, "_logged", set())
    logger = logging.getLogger("omni_jax.test_dispatch_log")
    caplog.set_level(logging.INFO, logger="omni_jax")
    dispatch_log.log_once(logger, logging.DEBUG, "below the level")  # not logged, not marked
    for _ in range(3):
        dispatch_log.log_once(logger, logging.INFO, "chosen")
    caplog.set_level(logging.DEBUG, logger="omni_jax")
    dispatch_log.log_once(logger, logging.DEBUG, "below the level")
    dispatch_log.log_once(logger, logging.WARNING, "chosen")
    assert [(r.levelno, r.getMessage()) for r in caplog.records] == [
        (logging.INFO, "chosen"), (logging.DEBUG, "below the level"),
        (logging.WARNING, "chosen")]

"""Forcing fields of a kernel's default config in a test (the backends look their configs
up while tracing, so a patched look-up reaches the kernels)."""

import dataclasses
from typing import Any


def force_config_fields(monkeypatch, module: Any, lookup: str, **fields: Any) -> None:
    """Makes ``module.lookup`` return its default config with ``fields`` replaced."""
    default = getattr(module, lookup)
    monkeypatch.setattr(module, lookup, lambda *args, **kwargs: dataclasses.replace(
        default(*args, **kwargs), **fields))

"""The place of this device along a context-parallel mesh axis, checked at trace time."""

from __future__ import annotations

from typing import Any

from jax import lax


def axis_size(name: str) -> int:
    """The number of devices along mesh axis ``name``; a ValueError naming it when this
    code is not inside a `jax.shard_map` over a mesh with that axis."""
    if not isinstance(name, str):
        raise ValueError(f"context_axis must be a mesh axis name (str), got {name!r}")
    try:
        return int(lax.axis_size(name))
    except NameError:
        raise ValueError(
            f"context_axis={name!r} is not an axis of the enclosing jax.shard_map (context "
            f"parallel attention runs inside a shard_map whose mesh has that axis)") from None


def axis_index(name: str) -> Any:
    """This device's index along ``name`` (traced)."""
    return lax.axis_index(name)

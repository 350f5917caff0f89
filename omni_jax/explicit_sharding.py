"""The ops on arrays sharded along Explicit mesh axes (`jax.sharding.AxisType.Explicit`).

In explicit sharding mode every array's `PartitionSpec` is part of its type, and each
operation must resolve its output's (a gather or a contraction over a sharded axis
raises `ShardingTypeError` otherwise). The ops run with those axes turned Auto
(`jax.sharding.auto_axes`), as under a plain jit with sharded inputs, and give their
results the sharding the inputs imply.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import PartitionSpec

Array = Any


def spec_of(x: Array) -> PartitionSpec | None:
    """``x``'s PartitionSpec when ``x`` is sharded along an Explicit mesh axis, else None
    (replicated, Auto axes, or no mesh: nothing to resolve)."""
    sharding = getattr(jax.typeof(x), "sharding", None)
    explicit = set(getattr(getattr(sharding, "mesh", None), "explicit_axes", ()))
    spec = getattr(sharding, "spec", None)
    named = lambda entry: set(entry if isinstance(entry, tuple) else (entry,))
    if spec is None or not any(named(entry) & explicit for entry in spec):
        return None
    return spec


def any_sharded(*arrays: Array) -> bool:
    return any(spec_of(x) is not None for x in jax.tree.leaves(arrays))


def dims(spec: PartitionSpec | None, ndim: int) -> tuple:
    """The spec's entry per dimension (None where unsharded or ``spec`` is None)."""
    entries = tuple(spec) if spec is not None else ()
    return (*entries, *(None,) * (ndim - len(entries)))


def unique(entries: Sequence) -> PartitionSpec:
    """A PartitionSpec of ``entries`` with each mesh axis used once (its first use)."""
    seen: set = set()
    result = []
    for entry in entries:
        names = entry if isinstance(entry, tuple) else (entry,)
        if entry is None or seen & set(names):
            result.append(None)
            continue
        seen |= set(names)
        result.append(entry)
    return PartitionSpec(*result)


def tracing_without_explicit_mesh() -> contextlib.AbstractContextManager:
    """A context for tracing a user's function on scalars (score_mod, mask_mod) whose jaxpr
    is evaluated elsewhere: under a mesh with Explicit axes (`jax.set_mesh`) the trace
    would bind that mesh into every aval, and evaluating it where those axes are Auto
    (`call`) fails; traced without a mesh it runs in either."""
    if not explicit_mesh():
        return contextlib.nullcontext()
    return jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((), ()))


def plain_constants(tree: Any) -> Any:
    """``tree`` with its concrete arrays placed on an explicit mesh copied to plain
    (single-device) constants: typed by that mesh, they cannot enter code where its axes
    are Auto (`call`); other leaves are kept."""

    def one(x):
        mesh = getattr(getattr(x, "sharding", None), "mesh", None)
        if isinstance(x, jax.core.Tracer) or not getattr(mesh, "explicit_axes", ()):
            return x
        with jax.ensure_compile_time_eval():
            return jax.numpy.asarray(np.asarray(x))

    return jax.tree.map(one, tree)


def explicit_mesh() -> bool:
    """Whether tracing happens under a mesh with Explicit axes (`jax.set_mesh`)."""
    return bool(getattr(jax.sharding.get_abstract_mesh(), "explicit_axes", ()))


def call(fn: Callable, operands: Sequence, out_specs: Callable[[], Any]) -> Any:
    """``fn(*operands)``; where an operand is sharded along an Explicit mesh axis, with
    those axes Auto inside and the results sharded as ``out_specs()`` (a pytree of
    PartitionSpecs matching the results).

    Under `jax.vmap` an operand's type shows one example, not the mapped axis, which may
    be sharded: under an explicit mesh every call goes through `auto_axes`, whose batching
    keeps the mapped axis's sharding, so the kernels never see a sharded type.
    """
    if not any_sharded(operands) and not explicit_mesh():
        return fn(*operands)
    return jax.sharding.auto_axes(fn, out_sharding=out_specs())(*operands)

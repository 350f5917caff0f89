"""Context parallelism on arrays whose type says they are sharded along the sequence
(`jax.sharding.AxisType.Explicit`), under a plain `jax.jit` with no `jax.shard_map`:
the call wraps itself in one over the arrays' mesh, each operand keeping its spec."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
from jax.sharding import PartitionSpec as P

from omni_jax import explicit_sharding

Array = Any


def bound(axis: str) -> bool:
    """Whether ``axis`` is an axis of an enclosing shard_map (or vmap)."""
    try:
        jax.lax.axis_size(axis)
    except (NameError, TypeError):
        return False
    return True


def sequence_sharded(axis: str, query: Array) -> bool:
    """Whether ``query``'s type shards its sequence dimension along Explicit ``axis``."""
    entry = explicit_sharding.dims(explicit_sharding.spec_of(query), 4)[1]
    return axis in (entry if isinstance(entry, tuple) else (entry,))


def call_per_shard(fn: Callable[..., tuple[Array, Array]], operands: dict[str, Array | None],
                   ) -> tuple[Array, Array]:
    """``fn(**operands) -> (out, lse)`` inside a shard_map over the query's mesh: each
    operand enters with its own spec, out leaves as the query and lse as its rows."""
    query = operands["query"]
    mesh = jax.typeof(query).sharding.mesh
    given = {name: x for name, x in operands.items() if x is not None}
    specs = {name: explicit_sharding.spec_of(x) or P() for name, x in given.items()}
    batch, rows, heads, _ = explicit_sharding.dims(specs["query"], 4)
    return jax.shard_map(lambda arrays: fn(**arrays), mesh=mesh, in_specs=(specs,),
                         out_specs=(P(batch, rows, heads, None), P(batch, heads, rows)))(given)

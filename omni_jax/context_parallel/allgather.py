"""The all-gather strategy: every device gathers all K/V blocks, then attends its own
queries to them in one step. Best where K/V are small against the queries (GQA, MQA):
one collective instead of n hops, and one large kernel call instead of n small ones."""

from __future__ import annotations

from typing import Any

from jax import lax

Array = Any


def gather_keys(axis: str, k: Array, v: Array, kv_ids: Array | None) -> tuple:
    """K, V (and kv segment ids) of every device, in device order along the sequence.
    Their transpose under `jax.grad` is a reduce-scatter: each device gets its dK/dV."""
    gather = lambda x: None if x is None else lax.all_gather(x, axis, axis=1, tiled=True)
    return gather(k), gather(v), gather(kv_ids)

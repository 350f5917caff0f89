"""Context parallelism: one attention call over a sequence sharded along a mesh axis.

Inside `jax.shard_map`, ``omni_jax.attention(..., context_axis="seq")`` takes this
device's shard of the sequence (queries, keys, values, segment ids) and returns this
device's shard of the output and lse; masks keep their global meaning. Strategies:

* ``"ring"`` (`omni_jax.context_parallel.ring`): K/V blocks travel around the devices
  with `lax.ppermute` while the current block computes;
* ``"allgather"`` (`omni_jax.context_parallel.allgather`): K/V gathered, one step.

``context_strategy=None`` picks "allgather" when K/V are at most a quarter of the size of
the queries (``num_q_heads >= 4 * num_kv_heads``: GQA / MQA, where gathering them costs
little memory and traffic) and "ring" otherwise.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from omni_jax.backends import plan_attention
from omni_jax.context_parallel import allgather, explicit, mesh_axis, ring
from omni_jax.context_parallel.layout import LAYOUTS, check_layout, unzigzag, zigzag
from omni_jax.context_parallel.steps import ContextCall
from omni_jax.problem import AttentionProblem

Array = Any
STRATEGIES = ("ring", "allgather")

__all__ = ["LAYOUTS", "STRATEGIES", "attention_over_axis", "check_arguments", "choose_strategy",
           "explicit", "mesh_axis", "unzigzag", "zigzag"]


def choose_strategy(num_q_heads: int, num_kv_heads: int) -> str:
    """The strategy ``context_strategy=None`` takes (see the module docstring)."""
    return "allgather" if num_q_heads >= 4 * num_kv_heads else "ring"


def check_arguments(strategy: str | None, layout: str) -> None:
    """Raises for an unknown strategy or layout (before the axis is looked up)."""
    if strategy is not None and strategy not in STRATEGIES:
        raise ValueError(f"context_strategy must be None or one of {STRATEGIES}, "
                         f"got {strategy!r}")
    if layout not in LAYOUTS:
        raise ValueError(f"context_layout must be one of {LAYOUTS}, got {layout!r}")


def attention_over_axis(problem: AttentionProblem, implementation: str | None, q: Array,
                        k: Array, v: Array, *, is_causal: bool,
                        window: tuple[int, int] | None,
                        segments: tuple[Array, Array] | None, sinks: Array | None, axis: str,
                        strategy: str | None, layout: str) -> tuple[Array, Array]:
    """(out, lse) of ``omni_jax.attention`` with ``context_axis=axis``, for validated
    arguments: ``problem`` describes the local shards."""
    check_arguments(strategy, layout)
    num_shards = mesh_axis.axis_size(axis)
    check_layout(layout, problem.q_len)
    check_layout(layout, problem.kv_len)
    strategy = strategy or choose_strategy(problem.num_q_heads, problem.num_kv_heads)
    q_ids, kv_ids = segments if segments is not None else (None, None)
    rotate = strategy == "ring" and num_shards > 1
    if not rotate:
        k, v, kv_ids = allgather.gather_keys(axis, k, v, kv_ids)
    step_problem = dataclasses.replace(problem, kv_len=k.shape[1], has_sinks=False)
    call = ContextCall(plan=plan_attention(implementation, step_problem), is_causal=is_causal,
                       window=window, axis=axis, num_shards=num_shards, layout=layout,
                       rotate=rotate)
    return ring.context_attention(call, q, k, v, q_ids, kv_ids, sinks)

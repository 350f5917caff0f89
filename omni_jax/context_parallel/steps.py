"""One step of context-parallel attention: local queries against one block of keys.

A step is the backend's own forward or backward on local arrays, with a `BlockMask`
that puts rows and keys at their global positions (`AtPositions`), so causal and window
masks keep their global meaning and the kernels skip the tiles the mask leaves empty.
Partial results of steps combine by their log-sum-exp (`merge`).

The step masks are traced (positions depend on `lax.axis_index`), so the kernels cannot
read their walk lengths while choosing configs; `step_walk_hint` computes them at trace
time for every device and the mask carries their mean as its ``walk_hint``.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from omni_jax.backends import AttentionPlan
from omni_jax.context_parallel.layout import shard_positions, shard_ranges
from omni_jax.masks import BlockGrid, BlockMask
from omni_jax.masks.block_mask import mark_kv_tail
from omni_jax.masks.construct import structured_tile_flags
from omni_jax.masks.mask_mods import (
    And,
    AtPositions,
    Causal,
    MaskMod,
    SlidingWindow,
    document_mask,
)
from pallas_kernels import compat
from pallas_kernels.block_sparse import WalkStatistics

Array = Any


@dataclasses.dataclass(frozen=True)
class ContextCall:
    """What is static about one context-parallel call (a jit / custom_vjp static key).

    ``plan``: the backends and the problem of one step (local query rows, ``kv_len`` keys
    of one step, no sinks: they join once per row, after the last step).
    ``rotate``: the ring (K/V blocks visit every device in turn) or False: the keys are
    all of them, gathered in device order (the all-gather strategy).
    """

    plan: AttentionPlan
    is_causal: bool
    window: tuple[int, int] | None
    axis: str
    num_shards: int
    layout: str
    rotate: bool

    def q_positions(self, shard: Any) -> Array:
        return shard_positions(self.layout, shard, self.num_shards, self.plan.problem.q_len)

    def kv_positions(self, source: Any) -> Array:
        """Global positions of the keys of a step whose block came from device ``source``
        (ring) or of all keys (``source`` None: the all-gather strategy)."""
        if self.rotate:
            return shard_positions(self.layout, source, self.num_shards,
                                   self.plan.problem.kv_len)
        shard_len = self.plan.problem.kv_len // self.num_shards
        return jnp.concatenate([shard_positions(self.layout, j, self.num_shards, shard_len)
                                for j in range(self.num_shards)])

    def visible_by_position(self, step: int) -> np.ndarray:
        """Per device: whether causal/window leave its queries some key of ``step``'s
        block (documents aside). Known at trace time, so that a step empty everywhere
        is left out and a step visible everywhere needs no `lax.cond` (whose predicate
        a GPU reads back to the host)."""
        n, problem = self.num_shards, self.plan.problem
        # Visible keys lie at kv - q in [low, high] of the query's position.
        low = -math.inf if self.window is None else -self.window[0]
        high = min(math.inf if self.window is None else self.window[1],
                   0 if self.is_causal else math.inf)
        visible = np.zeros(n, bool)
        for device in range(n):
            q_runs = shard_ranges(self.layout, device, n, problem.q_len)
            if self.rotate:
                kv_runs = shard_ranges(self.layout, (device - step) % n, n, problem.kv_len)
            else:
                kv_runs = [run for j in range(n) for run in shard_ranges(
                    self.layout, j, n, problem.kv_len // n)]
            visible[device] = any(k_first - q_last <= high and k_last - q_first >= low
                                  for q_first, q_last in q_runs for k_first, k_last in kv_runs)
        return visible


def step_mask(call: ContextCall, step: int, q_positions: Array, kv_positions: Array,
              q_ids: Array | None, kv_ids: Array | None) -> BlockMask:
    """The BlockMask of one step: the call's mask arguments at these global positions,
    with the step's `step_walk_hint` unless segment ids (data) shape it too."""
    mask_mod = _mask_mod(call, q_positions, kv_positions, q_ids, kv_ids)
    problem = call.plan.problem
    grid = BlockGrid(problem.q_len, problem.kv_len, *problem.block_size)
    mask = BlockMask.from_tile_flags(structured_tile_flags(mask_mod, grid), mask_mod=mask_mod,
                                     q_len=grid.q_len, kv_len=grid.kv_len,
                                     block_size=problem.block_size, contiguous_full=False)
    return mask if q_ids is not None else mask.with_walk_hint(step_walk_hint(call, step))


def _device_walk_statistics(call: ContextCall, step: int, device: int) -> WalkStatistics:
    """The walk lengths of ``step``'s mask on ``device`` (documents aside), in numpy."""
    source = (device - step) % call.num_shards if call.rotate else None
    problem = call.plan.problem
    grid = BlockGrid(problem.q_len, problem.kv_len, *problem.block_size)
    with jax.ensure_compile_time_eval():
        mask_mod = _mask_mod(call, call.q_positions(device), call.kv_positions(source),
                             None, None)
        flags = mark_kv_tail(structured_tile_flags(mask_mod, grid), grid)
        return WalkStatistics.of_tile_flags(np.asarray(flags))


@functools.lru_cache(maxsize=256)
def step_walk_hint(call: ContextCall, step: int) -> WalkStatistics:
    """The walk hint of ``step``'s masks: the mean of `_device_walk_statistics` over the
    devices that run the step (those with an active tile; the others skip it, see
    `any_visible`). A config choice, so one hint for all devices suffices: exact on each
    where the statistics agree (a causal zigzag ring), a mean where they differ."""
    per_device = [_device_walk_statistics(call, step, device)
                  for device in range(call.num_shards)]
    running = [s for s in per_device if s.mean_kv_blocks > 0]
    return WalkStatistics.mean(running or per_device)


def _mask_mod(call: ContextCall, q_positions: Array, kv_positions: Array,
              q_ids: Array | None, kv_ids: Array | None) -> MaskMod | None:
    """The step's structured mask: causal/window at these positions AND documents."""
    parts: list[MaskMod] = []
    positional = [Causal()] if call.is_causal else []
    if call.window is not None:
        positional.append(SlidingWindow(*call.window))
    if positional:
        inner = positional[0] if len(positional) == 1 else And(*positional)
        parts.append(AtPositions(inner, q_positions[None], kv_positions[None]))
    if q_ids is not None:
        parts.append(document_mask(q_ids, kv_ids))
    return None if not parts else parts[0] if len(parts) == 1 else And(*parts)


def any_visible(mask: BlockMask) -> Array:
    """Whether some query of the step sees some key (else the step is skipped)."""
    return jnp.any(mask.kv_num_blocks > 0)


def step_forward(call: ContextCall, q: Array, k: Array, v: Array, mask: BlockMask,
                 guarded: bool) -> tuple[Array, Array]:
    """(out, lse) of the step, out in the lse's dtype; zeros and -inf when it is empty
    (``guarded``: a `lax.cond` skips the computation then)."""
    problem = call.plan.problem
    lse_dtype = jnp.promote_types(q.dtype, jnp.float32)

    def compute(q, k, v, mask):
        out, lse = call.plan.forward.forward(problem, q, k, v, mask, None, ())
        return out.astype(lse_dtype), lse.astype(lse_dtype)

    def skip(q, k, v, mask):
        nothing = (jnp.zeros((*q.shape[:3], problem.head_dim_v), lse_dtype),
                   jnp.full((q.shape[0], q.shape[2], q.shape[1]), -jnp.inf, lse_dtype))
        return _vary_like(nothing, (q, k, v, mask))

    if not guarded:
        return compute(q, k, v, mask)
    return jax.lax.cond(any_visible(mask), compute, skip, q, k, v, mask)


def step_backward(call: ContextCall, q: Array, k: Array, v: Array, mask: BlockMask,
                  out: Array, lse: Array, dout: Array, dlse: Array,
                  guarded: bool) -> tuple[Array, Array, Array]:
    """(dq, dk, dv) of the step's keys, from the call's final ``out`` and ``lse``: the
    probabilities ``exp(score - lse)`` are then those of the softmax over all keys."""
    problem = call.plan.problem

    def compute(q, k, v, mask):
        dq, dk, dv, _, _ = call.plan.backward.backward(problem, q, k, v, mask, None, (), out,
                                                       lse, dout, dlse)
        return dq, dk, dv

    def skip(q, k, v, mask):
        nothing = jnp.zeros_like(q), jnp.zeros_like(k), jnp.zeros_like(v)
        return _vary_like(nothing, (q, k, v, mask, out, lse, dout, dlse))

    if not guarded:
        return compute(q, k, v, mask)
    return jax.lax.cond(any_visible(mask), compute, skip, q, k, v, mask)


def _vary_like(result: Any, operands: Any) -> Any:
    """``result`` typed as varying along the mesh axes of ``operands``, as the backend's
    results are (both branches of a `lax.cond` inside a shard_map must agree)."""
    return compat.vary(result, compat.varying_axes(operands))


def merge(out_a: Array, lse_a: Array, out_b: Array, lse_b: Array) -> tuple[Array, Array]:
    """Two partial softmax results over disjoint keys as one: weights ``exp(lse_x - lse)``;
    rows that saw no key in either stay zeros with lse -inf (no NaN)."""
    lse = jnp.logaddexp(lse_a, lse_b)
    finite = jnp.where(lse == -jnp.inf, 0.0, lse)

    def weight(part_lse):
        return jnp.swapaxes(jnp.exp(part_lse - finite), 1, 2)[..., None]

    return out_a * weight(lse_a) + out_b * weight(lse_b), lse

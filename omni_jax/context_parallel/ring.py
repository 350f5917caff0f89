"""Context-parallel attention as a ring, and the custom_vjp both strategies share.

Forward: at step s device i attends its queries to the K/V block of device
``i - s (mod n)``, while `lax.ppermute` already sends that block on to device i + 1;
partial results merge by their lse, and sinks join once at the end. Steps that causal
or window masks leave empty on every device are left out at trace time; steps empty on
some devices only are skipped there by a `lax.cond`. Backward: each
step recomputes its probabilities from the final lse (the backend's own backward),
dQ accumulates locally and the dK/dV accumulators travel with their K/V block, one hop
behind it; a last hop sends each home.

With ``call.rotate`` False the keys are already all of them (the all-gather strategy):
one step, no hops; JAX differentiates the gather (a reduce-scatter of dK/dV).
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from omni_jax.context_parallel.steps import (
    ContextCall,
    merge,
    step_backward,
    step_forward,
    step_mask,
)
from omni_jax.scores import zero_cotangent
from pallas_kernels import compat
from pallas_kernels.softmax import fold_sinks, sinks_cotangent, softmax_delta

Array = Any


def context_attention(call: ContextCall, q: Array, k: Array, v: Array, q_ids: Array | None,
                      kv_ids: Array | None, sinks: Array | None) -> tuple[Array, Array]:
    """(out, lse) of this device's queries against the keys ``call`` describes."""
    # One varying type for every operand, so the custom_vjp's cotangents of replicated
    # ones (sinks) are summed over the devices (as in `omni_jax.attention`).
    return _context_attention(call, *compat.vary_alike((q, k, v, q_ids, kv_ids, sinks)))


def _visible_steps(call: ContextCall) -> list[tuple[int, np.ndarray]]:
    """``(step, visible per device)`` up to the last step that some device needs: the
    blocks stop travelling there (a window reaches only the nearest blocks)."""
    steps = [(step, call.visible_by_position(step))
             for step in range(call.num_shards if call.rotate else 1)]
    last = max((step for step, visible in steps if visible.any()), default=0)
    return steps[:last + 1]


def _to_next_device(call: ContextCall, tree: Any, hops: int = 1) -> Any:
    n = call.num_shards
    return lax.ppermute(tree, call.axis, [(i, (i + hops) % n) for i in range(n)])


def _source(call: ContextCall, step: int) -> Any:
    """The device whose K/V block is here at ``step`` (None: all keys are here)."""
    if not call.rotate:
        return None
    return (lax.axis_index(call.axis) - step) % call.num_shards


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _context_attention(call, q, k, v, q_ids, kv_ids, sinks):
    return _forward(call, q, k, v, q_ids, kv_ids, sinks)[0]


def _forward(call, q, k, v, q_ids, kv_ids, sinks):
    q_positions = call.q_positions(lax.axis_index(call.axis))
    block = (k, v, kv_ids)
    out = lse = None
    steps = _visible_steps(call)
    for step, visible in steps:
        if step + 1 < len(steps):  # sent before this step computes: they overlap
            next_block = _to_next_device(call, block)
        if visible.any():
            k_s, v_s, ids_s = block
            mask = step_mask(call, step, q_positions, call.kv_positions(_source(call, step)),
                             q_ids, ids_s)
            part = step_forward(call, q, k_s, v_s, mask, guarded=not visible.all())
            out, lse = part if out is None else merge(out, lse, *part)
        if step + 1 < len(steps):
            block = next_block
    out = out.astype(q.dtype)  # step 0 (the device's own block) is never left out
    if sinks is not None:
        out, lse = fold_sinks(out, lse, sinks)
    return (out, lse), (q, k, v, q_ids, kv_ids, sinks, out, lse)


def _backward(call, residuals, cotangents):
    q, k, v, q_ids, kv_ids, sinks, out, lse = residuals
    dout, dlse = cotangents
    q_positions = call.q_positions(lax.axis_index(call.axis))
    accumulate = jnp.promote_types(q.dtype, jnp.float32)
    dq = jnp.zeros(q.shape, accumulate)
    dkv = (jnp.zeros(k.shape, accumulate), jnp.zeros(v.shape, accumulate))
    block = (k, v, kv_ids)
    steps = _visible_steps(call)
    for step, visible in steps:
        if step + 1 < len(steps):
            next_block = _to_next_device(call, block)
        if visible.any():
            k_s, v_s, ids_s = block
            mask = step_mask(call, step, q_positions, call.kv_positions(_source(call, step)),
                             q_ids, ids_s)
            dq_s, dk_s, dv_s = step_backward(call, q, k_s, v_s, mask, out, lse, dout, dlse,
                                             guarded=not visible.all())
            dq = dq + dq_s
            dkv = (dkv[0] + dk_s, dkv[1] + dv_s)
        if step + 1 < len(steps):  # one hop behind its block
            dkv = _to_next_device(call, dkv)
            block = next_block
    if call.rotate:  # home: the block here came from ``last step`` devices back
        dkv = _to_next_device(call, dkv, hops=call.num_shards - steps[-1][0])
    dsinks = (None if sinks is None
              else sinks_cotangent(sinks, lse, softmax_delta(out, dout, dlse)))
    return (dq.astype(q.dtype), dkv[0].astype(k.dtype), dkv[1].astype(v.dtype),
            jax.tree.map(zero_cotangent, q_ids), jax.tree.map(zero_cotangent, kv_ids), dsinks)


_context_attention.defvjp(_forward, _backward)

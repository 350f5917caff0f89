"""`omni_jax.attention`: the one definition of what masked attention computes.

    out[b, i, h] = sum_j softmax_j(score(b, h, i, j)) * value[b, j, h // group]

where ``score = score_mod(softcap(scale * q.k), b, h, i, j)``, masked keys
(any mask argument says no) get -inf, and learnable ``sinks[h]`` join the
softmax denominator only. All mask arguments combine with logical AND.

This module validates the arguments (errors at trace time), turns every
mask argument into one `BlockMask`, hoists arrays captured by ``score_mod``
and owns the custom_vjp; the chosen backend only computes forward/backward.
"""

from __future__ import annotations

import functools
import hashlib
import math
import weakref
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from omni_jax import context_parallel, explicit_sharding, query_groups, validation
from omni_jax.backends import AttentionPlan, get_backend, plan_attention
from omni_jax.masks import BlockGrid, BlockMask
from omni_jax.masks.construct import structured_tile_flags
from omni_jax.masks.mask_mods import (
    And,
    Causal,
    MaskMod,
    SlidingWindow,
    document_mask,
    has_contiguous_full_tiles,
)
from omni_jax.masks.regroup import regroup, regroupable
from omni_jax.problem import AttentionProblem
from omni_jax.scores import convert_score_mod, zero_cotangent
from pallas_kernels import compat
from pallas_kernels.softmax import fold_sinks
from pallas_kernels.tile_classes import trace_time_eval

Array = Any


def attention(query: Array, key: Array, value: Array, *, mask: BlockMask | None = None,
              is_causal: bool = False, local_window_size: int | tuple[int, int] | None = None,
              q_segment_ids: Array | None = None, kv_segment_ids: Array | None = None,
              score_mod: Callable | None = None, softcap: float | None = None,
              sinks: Array | None = None, scale: float | None = None, return_lse: bool = False,
              implementation: str | None = None, context_axis: str | None = None,
              context_strategy: str | None = None, context_layout: str = "contiguous",
              deterministic: bool = True) -> Array | tuple[Array, Array]:
    """Exact, differentiable, block-sparse attention.

    Args:
      query: ``[batch, q_len, num_q_heads, head_dim]`` (as
        `jax.nn.dot_product_attention`; transpose ``[batch, heads, seq, dim]``
        arrays first: where the shapes allow both readings, nothing can tell).
      key: ``[batch, kv_len, num_kv_heads, head_dim]``; ``num_q_heads`` must be
        a multiple of ``num_kv_heads`` (GQA / MQA).
      value: ``[batch, kv_len, num_kv_heads, head_dim_v]`` (``head_dim_v`` may
        differ from ``head_dim``). query, key and value share one float dtype.
      mask: a `BlockMask` from `create_block_mask` (batch and heads 1 or full).
      is_causal: query i sees keys j <= i (top-left aligned).
      local_window_size: ``(left, right)`` (or one int for both): query i sees
        keys j in ``[i - left, i + right]``.
      q_segment_ids, kv_segment_ids: int ``[batch, q_len]`` / ``[batch, kv_len]``
        document ids of packed sequences; a query sees only keys of its document.
        When q_len == kv_len one of them may stand for both.
      score_mod: ``score_mod(score, batch_idx, head_idx, q_idx, kv_idx) -> score``
        on scalars (FlexAttention semantics), applied after scaling and softcap,
        before masking. It may capture arrays (gradients flow to float ones). It is
        called with indices inside the sequences only.
      softcap: ``softcap * tanh(score / softcap)`` (Gemma 2).
      sinks: float ``[num_q_heads]`` sink logits that join the softmax
        denominator only (gpt-oss).
      scale: score scale, default ``1 / sqrt(head_dim)``.
      return_lse: also return the log-sum-exp ``[batch, num_q_heads, q_len]``
        (float32; float64 for float64 inputs), natural log, sinks included.
      implementation: None (best available), "xla", "triton" or "mosaic".
      context_axis: inside `jax.shard_map`, the mesh axis along which the sequence is
        sharded (context parallelism, `omni_jax.context_parallel`): query, key, value
        and segment ids are this device's shard, the result is its shard of out and
        lse, and masks keep their global positions. Under a plain `jax.jit`, arrays
        whose type shards the sequence along that (Explicit) axis work alike, the
        call running per shard. Not with ``mask`` or ``score_mod``.
      context_strategy: None (chosen from the head counts), "ring" or "allgather".
      context_layout: "contiguous" (device i holds the i-th slice) or "zigzag" (chunks
        i and 2n-1-i of 2n, see `omni_jax.context_parallel.zigzag`).
      deterministic: gradients identical bit for bit from run to run (the default).
        False lets the Mosaic backward on Hopper and Blackwell add dQ from its dK/dV
        kernel by atomic reduce-adds, 5 matmuls a tile instead of 7 (docs/performance.md
        has the measured gain), whose float32 sums then vary in their last bits between
        runs. The forward is the same either way.

    Returns:
      ``out [batch, q_len, num_q_heads, head_dim_v]`` in query's dtype, or
      ``(out, lse)``. A query that sees no key gets zeros and lse = -inf (its
      sink logit when sinks are given) and zero gradients; so does every query
      when kv_len is 0 (batch and q_len may be 0 too: empty results).
    """
    validation.check_qkv(query, key, value)
    batch, q_len, num_q_heads, head_dim = query.shape
    kv_len, num_kv_heads = key.shape[1:3]
    is_causal = validation.check_flag("is_causal", is_causal)
    return_lse = validation.check_flag("return_lse", return_lse)
    deterministic = validation.check_flag("deterministic", deterministic)
    window = validation.check_window(local_window_size)
    segments = validation.check_segment_ids(q_segment_ids, kv_segment_ids, batch=batch,
                                            q_len=q_len, kv_len=kv_len)
    validation.check_block_mask(mask, batch=batch, num_q_heads=num_q_heads, q_len=q_len,
                                kv_len=kv_len)
    softcap = validation.check_scalar("softcap", softcap, positive=True)
    scale = validation.check_scalar("scale", scale, positive=False)
    sinks = validation.check_sinks(sinks, num_q_heads)
    validation.check_implementation(implementation)
    if context_axis is not None:
        if (not context_parallel.explicit.bound(context_axis)
                and context_parallel.explicit.sequence_sharded(context_axis, query)):
            per_shard = functools.partial(
                attention, is_causal=is_causal, local_window_size=local_window_size,
                softcap=softcap, scale=scale, return_lse=True, implementation=implementation,
                context_axis=context_axis, context_strategy=context_strategy,
                context_layout=context_layout, mask=mask, score_mod=score_mod,
                deterministic=deterministic)
            q_ids, kv_ids = segments or (None, None)
            out, lse = context_parallel.explicit.call_per_shard(per_shard, dict(
                query=query, key=key, value=value, q_segment_ids=q_ids, kv_segment_ids=kv_ids,
                sinks=sinks))
            return (out, lse) if return_lse else out
        _check_context_parallel(context_axis, context_strategy, context_layout, mask, score_mod)
    converted, captured = (None, []) if score_mod is None else convert_score_mod(
        score_mod, (q_len, kv_len))
    if not (batch and q_len and kv_len):
        out, lse = _nothing_to_attend(query, value, sinks)
        return (out, lse) if return_lse else out

    problem = AttentionProblem(
        batch=batch, q_len=q_len, kv_len=kv_len, num_q_heads=num_q_heads,
        num_kv_heads=num_kv_heads, head_dim=head_dim, head_dim_v=value.shape[-1],
        dtype=jnp.dtype(query.dtype),
        scale=1.0 / math.sqrt(head_dim) if scale is None else scale, softcap=softcap,
        score_mod=converted, has_sinks=sinks is not None, has_user_mask=mask is not None,
        block_size=None if mask is None else mask.block_size, deterministic=deterministic)
    if context_axis is not None:
        out, lse = context_parallel.attention_over_axis(
            problem, implementation, query, key, value, is_causal=is_causal, window=window,
            segments=segments, sinks=sinks, axis=context_axis, strategy=context_strategy,
            layout=context_layout)
        return (out, lse) if return_lse else out
    group = query_groups.packing_group(problem, mask)
    # A concrete BlockMask of a block size the backend declines is re-tiled to its own.
    retile = None if mask is None else (lambda size: regroupable(mask, size) is None)
    plan = plan_attention(implementation, query_groups.packed_problem(problem, group),
                          retile=retile)
    if plan.problem.block_size[0] % group:  # packed tiles must each lie in one q-block
        group, plan = 1, plan_attention(implementation, problem, retile=retile)
    if mask is not None and tuple(mask.block_size) != plan.problem.block_size:
        mask = regroup(mask, plan.problem.block_size)
    trace_keys = (plan.forward.trace_key(plan.problem), plan.backward.trace_key(plan.problem))
    # In a traced call a concrete BlockMask stays concrete inside the jit (a static
    # argument, compared by value), so that the kernels still get its walks as constants.
    # An eager call passes it as an operand: masks that differ in values alone (a new
    # document mask at every step) then share one compile.
    concrete_mask = (_ByValue(mask) if mask is not None and not _is_traced(mask)
                     and _is_traced((query, key, value)) else None)
    call = functools.partial(_masked_attention, plan=plan,
                             structure=(is_causal, window, concrete_mask, group),
                             trace_keys=trace_keys)
    operands = (query, key, value, None if concrete_mask else mask, segments, sinks,
                tuple(captured))
    out, lse = explicit_sharding.call(call, operands, lambda: _out_specs(query))
    return (out, lse) if return_lse else out


def _check_context_parallel(axis: str, strategy: str | None, layout: str,
                            mask: BlockMask | None, score_mod: Callable | None) -> None:
    """Trace-time errors for a context-parallel call: unknown axis, strategy or layout,
    and the arguments it does not take (their indices would be local to the shard)."""
    context_parallel.check_arguments(strategy, layout)
    context_parallel.mesh_axis.axis_size(axis)
    for name, value in (("mask", mask), ("score_mod", score_mod)):
        if value is not None:
            raise NotImplementedError(
                f"attention(context_axis={axis!r}) does not take {name}= yet: express the "
                f"mask with is_causal, local_window_size and segment ids")


def _nothing_to_attend(query: Array, value: Array, sinks: Array | None) -> tuple[Array, Array]:
    """The result of a call with no query or no key (batch, q_len or kv_len 0, as
    `jax.nn.dot_product_attention` takes them): what a query that sees no key gets."""
    batch, q_len, num_q_heads, _ = query.shape
    out = jnp.zeros((batch, q_len, num_q_heads, value.shape[-1]), query.dtype)
    lse_dtype = jnp.promote_types(query.dtype, jnp.float32)
    if sinks is None:
        return out, jnp.full((batch, num_q_heads, q_len), -jnp.inf, lse_dtype)
    lse = jnp.broadcast_to(sinks.astype(lse_dtype)[None, :, None], (batch, num_q_heads, q_len))
    return out, lse


def _out_specs(query: Array) -> tuple:
    """Where out ``[B, Sq, H, D]`` and lse ``[B, H, Sq]`` lie: as the query."""
    batch, rows, heads, _ = explicit_sharding.dims(explicit_sharding.spec_of(query), 4)
    return (explicit_sharding.unique((batch, rows, heads, None)),
            explicit_sharding.unique((batch, heads, rows)))


@functools.partial(jax.jit, static_argnames=("plan", "structure", "trace_keys"))
def _masked_attention(query, key, value, mask, segments, sinks, captured, *,
                      plan: AttentionPlan, structure: tuple, trace_keys: tuple):
    """The call's BlockMask, then the custom_vjp, under one jit: an eager call (no jit
    around `attention`) compiles once per plan, mask structure, backend trace keys and
    shapes, not at every call. ``structure``: (is_causal, window, concrete BlockMask,
    query group size packed into rows or 1: `omni_jax.query_groups`)."""
    del trace_keys  # Only a cache key: the backends read the same state while tracing.
    is_causal, window, concrete_mask, group = structure
    if concrete_mask is not None:
        mask = explicit_sharding.plain_constants(concrete_mask.value)
    block_mask = _effective_mask(mask, _argument_mask(is_causal, window, segments),
                                 plan.problem, group)
    static_mask, traced_mask = _split_by_concreteness(block_mask)
    folded_sinks = None
    if group > 1:
        query, folded_sinks, sinks = query_groups.pack_queries(query, group), sinks, None
    # Inside a jax.shard_map every operand varies along the same mesh axes, so that the
    # custom_vjp's cotangents have one type (those of replicated operands get summed).
    operands = compat.vary_alike((query, key, value, traced_mask, sinks, captured))
    out, lse = _attention(plan, static_mask, *operands)
    if group > 1:
        out, lse = query_groups.unpack(out, lse, group)
        if folded_sinks is not None:
            out, lse = fold_sinks(out, lse, folded_sinks)
    return out, lse


def _is_traced(tree: Any) -> bool:
    return any(isinstance(leaf, jax.core.Tracer) for leaf in jax.tree.leaves(tree))


class _ByValue:
    """A concrete pytree as a jit static argument: equal to another of the same structure,
    shapes, dtypes and values (compared by a digest, computed once per object)."""

    _digests: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def __init__(self, value: Any):
        self.value = value
        key = self._digests.get(value)
        if key is None:
            leaves, treedef = jax.tree.flatten(value)
            hasher = hashlib.blake2b(repr(treedef).encode())
            for leaf in leaves:
                leaf = np.ascontiguousarray(leaf)
                hasher.update(f"{leaf.dtype}{leaf.shape}".encode())
                hasher.update(leaf.tobytes())
            key = (treedef, hasher.digest())
            self._digests[value] = key
        self._key = key

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _ByValue) and self._key == other._key

    def __hash__(self) -> int:
        return hash(self._key)


def _argument_mask(is_causal: bool, window: tuple[int, int] | None,
                   segments: tuple[Array, Array] | None) -> MaskMod | None:
    """The structured mask of is_causal / local_window_size / segment ids, or None."""
    parts: list[MaskMod] = []
    if is_causal:
        parts.append(Causal())
    if window is not None:
        parts.append(SlidingWindow(*window))
    if segments is not None:
        parts.append(document_mask(*segments))
    if not parts:
        return None
    return parts[0] if len(parts) == 1 else And(*parts)


def _effective_mask(mask: BlockMask | None, structured: MaskMod | None,
                    problem: AttentionProblem, group: int) -> BlockMask:
    """One BlockMask for the call: the user's mask AND the argument masks; for a problem
    of packed query groups (``group`` > 1), with each query position repeated."""
    grid = BlockGrid(problem.q_len // group, problem.kv_len, *problem.block_size)
    with trace_time_eval(grid, mask, structured):
        if mask is not None:
            block_mask = mask if structured is None else mask.restrict(structured)
        else:
            block_mask = BlockMask.from_tile_flags(
                structured_tile_flags(structured, grid), mask_mod=structured,
                q_len=grid.q_len, kv_len=grid.kv_len, block_size=problem.block_size,
                contiguous_full=has_contiguous_full_tiles(structured))
        return block_mask if group == 1 else block_mask.repeat_queries(group)


def _split_by_concreteness(block_mask: BlockMask) -> tuple[BlockMask | None, BlockMask | None]:
    """``(mask, None)`` when none of its arrays is traced, else ``(None, mask)``.

    A mask known at trace time (causal, windows, BlockMasks built from static
    structure) crosses the custom_vjp as a non-differentiable Python value, so it
    is still concrete where the backends turn it into kernel operands: they do
    that once while tracing (`trace_time_eval`), and the kernels get constants
    instead of a few small XLA kernels launched before every call. Masks built
    from traced arrays (segment ids passed to a jitted function) are ordinary
    arguments.
    """
    return (None, block_mask) if _is_traced(block_mask) else (block_mask, None)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _attention(plan: AttentionPlan, static_mask, q, k, v, traced_mask, sinks, captured):
    block_mask = _either(static_mask, traced_mask)
    return plan.forward.forward(plan.problem, q, k, v, block_mask, sinks, captured)


def _attention_fwd(plan: AttentionPlan, static_mask, q, k, v, traced_mask, sinks, captured):
    out, lse = _forward(plan, static_mask, q, k, v, traced_mask, sinks, captured)
    return (out, lse), (q, k, v, traced_mask, sinks, captured, out, lse)


def _attention_bwd(plan: AttentionPlan, static_mask, residuals, cotangents):
    q, k, v, traced_mask, sinks, captured, out, lse = residuals
    dout, dlse = cotangents
    dq, dk, dv, dsinks, dfloat = _backward(plan, static_mask, q, k, v, traced_mask, sinks,
                                           captured, out, lse, dout, dlse)
    dfloat = iter(dfloat)
    dcaptured = tuple(next(dfloat) if _is_float(c) else zero_cotangent(c) for c in captured)
    return (dq, dk, dv, jax.tree.map(zero_cotangent, traced_mask), dsinks, dcaptured)


# The forward and backward passes differentiated once more, forward mode (jax.hessian,
# jax.jvp of jax.grad: the custom_vjp's own rules are then differentiated): the kernels
# have no derivatives, so the tangents are those of the XLA backend's passes.
@functools.partial(jax.custom_jvp, nondiff_argnums=(0, 1))
def _forward(plan: AttentionPlan, static_mask, q, k, v, traced_mask, sinks, captured):
    return _forward_pass(plan.forward, plan, static_mask, q, k, v, traced_mask, sinks, captured)


@_forward.defjvp
def _forward_jvp(plan: AttentionPlan, static_mask, primals, tangents):
    return jax.jvp(functools.partial(_forward_pass, get_backend("xla"), plan, static_mask),
                   primals, tangents)


def _forward_pass(backend, plan: AttentionPlan, static_mask, q, k, v, traced_mask, sinks,
                  captured):
    return backend.forward(plan.problem, q, k, v, _either(static_mask, traced_mask), sinks,
                           captured)


@functools.partial(jax.custom_jvp, nondiff_argnums=(0, 1))
def _backward(plan: AttentionPlan, static_mask, *operands):
    return _backward_pass(plan.backward, plan, static_mask, *operands)


@_backward.defjvp
def _backward_jvp(plan: AttentionPlan, static_mask, primals, tangents):
    return jax.jvp(functools.partial(_backward_pass, get_backend("xla"), plan, static_mask),
                   primals, tangents)


def _backward_pass(backend, plan: AttentionPlan, static_mask, q, k, v, traced_mask, sinks,
                   captured, out, lse, dout, dlse):
    """(dq, dk, dv, dsinks, cotangents of the float captured arrays)."""
    dq, dk, dv, dsinks, dcaptured = backend.backward(
        plan.problem, q, k, v, _either(static_mask, traced_mask), sinks, captured, out, lse,
        dout, dlse)
    return dq, dk, dv, dsinks, tuple(d for d, c in zip(dcaptured, captured, strict=True)
                                     if _is_float(c))


def _is_float(x: Array) -> bool:
    return jnp.issubdtype(x.dtype, jnp.inexact)


def _either(static_mask: BlockMask | None, traced_mask: BlockMask | None) -> BlockMask:
    return traced_mask if static_mask is None else static_mask


_attention.defvjp(_attention_fwd, _attention_bwd)

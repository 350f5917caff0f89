"""The pure-JAX backend: blockwise flash attention, forward and backward.

Runs anywhere XLA runs (CPU included) and is the reference the kernels are
tested against. Every q-block advances through its list of active kv-blocks
in lock-step (step j processes the j-th active kv-block of every q-block), so
each step holds one ``[q_len x block_kv]`` band of scores per head: memory is
O(seq x block), never O(seq^2), and MASKED tiles are never computed.

The backward pass recomputes each tile's scores and takes their VJP (through
softcap and score_mod) in the same q-major walk; dK/dV contributions are
scatter-added into their kv-blocks.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from omni_jax.backends.base import AttentionBackend
from omni_jax.masks import COMPUTED, PARTIAL, BlockMask
from omni_jax.problem import AttentionProblem
from omni_jax.scores import zero_cotangent
from pallas_kernels import compat
from pallas_kernels.score_pipeline import transform_scores

Array = Any
_HIGHEST = jax.lax.Precision.HIGHEST


def _compute_dtype(dtype) -> jnp.dtype:
    return jnp.promote_types(dtype, jnp.float32)


def _to_blocks(x: Array, block: int) -> Array:
    """``[B, S, H, D]`` -> ``[B, H, num_blocks, block, D]``, zero-padded."""
    batch, length, heads, dim = x.shape
    num_blocks = -(-length // block)
    x = jnp.pad(x, ((0, 0), (0, num_blocks * block - length), (0, 0), (0, 0)))
    return x.reshape(batch, num_blocks, block, heads, dim).transpose(0, 3, 1, 2, 4)


def _from_blocks(x: Array, length: int) -> Array:
    """Inverse of `_to_blocks`: ``[B, H, n, block, D]`` -> ``[B, length, H, D]``."""
    batch, heads, num_blocks, block, dim = x.shape
    x = x.transpose(0, 2, 3, 1, 4).reshape(batch, num_blocks * block, heads, dim)
    return x[:, :length]


def _rows_to_blocks(x: Array, block: int, pad_value: float = 0.0) -> Array:
    """``[B, H, S]`` -> ``[B, H, num_blocks, block]``, padded with ``pad_value``."""
    num_blocks = -(-x.shape[-1] // block)
    x = jnp.pad(x, ((0, 0), (0, 0), (0, num_blocks * block - x.shape[-1])),
                constant_values=pad_value)
    return x.reshape(*x.shape[:2], num_blocks, block)


@dataclasses.dataclass(frozen=True)
class _Walk:
    """The q-major walk of a BlockMask, broadcast to ``[B, Hq, nq(, nkv)]``."""

    num_blocks: Array
    indices: Array
    flags: Array
    partial_ids: Array

    @classmethod
    def of(cls, mask: BlockMask, batch: int, heads: int) -> _Walk:
        lead = (batch, heads, mask.grid.num_q_blocks)
        grow = lambda x: jnp.broadcast_to(x, lead + x.shape[3:])
        return cls(grow(mask.kv_num_blocks), grow(mask.kv_indices), grow(mask.kv_tile_flags),
                   grow(mask.kv_partial_ids))


class _Tiles:
    """Scores of step j of the walk: the j-th active kv-block of every q-block."""

    def __init__(self, problem: AttentionProblem, mask: BlockMask, walk: _Walk,
                 captured: Sequence[Array]):
        self.problem = problem
        self.mask = mask
        self.walk = walk
        self.captured = tuple(captured)
        batch, heads = problem.batch, problem.num_q_heads
        block_q, self.block_kv = mask.block_size
        num_q_blocks = mask.grid.num_q_blocks
        self.batch_idx = jnp.arange(batch)[:, None, None]
        self.head_idx = jnp.arange(heads)[None, :, None]
        self.kv_head_idx = self.head_idx // problem.group_size
        # Index grids shaped [B, Hq, nq, block_q, block_kv] by broadcasting.
        self.b5 = jnp.arange(batch)[:, None, None, None, None]
        self.h5 = jnp.arange(heads)[None, :, None, None, None]
        q_pos = jnp.arange(num_q_blocks)[:, None] * block_q + jnp.arange(block_q)
        self.q_pos = q_pos[None, None, :, :, None]

    def kv_block(self, j: Array) -> Array:
        return self.walk.indices[..., j]

    def gather(self, blocks: Array, kv_block: Array) -> Array:
        """The kv-block ``kv_block [B, Hq, nq]`` of ``blocks [B, Hkv, nkv, bkv, D]``."""
        return blocks[self.batch_idx, self.kv_head_idx, kv_block]

    def scores(self, j: Array, q_blocks: Array, k_tile: Array,
               float_captured: Sequence[Array]) -> Array:
        """Scaled, softcapped, score_mod-ed and masked scores ``[B, Hq, nq, bq, bkv]``."""
        problem = self.problem
        dtype = _compute_dtype(q_blocks.dtype)
        s = jnp.einsum("bhnqd,bhnkd->bhnqk", q_blocks, k_tile, preferred_element_type=dtype,
                       precision=_HIGHEST) * jnp.asarray(problem.scale, dtype)
        kv_block = self.kv_block(j)
        kv_pos = (kv_block[..., None] * self.block_kv + jnp.arange(self.block_kv))[..., None, :]
        s = transform_scores(s, softcap=problem.softcap, score_mod=problem.score_mod,
                             captured=self._merge_captured(float_captured), b=self.b5,
                             h=self.h5, q_idx=self.q_pos, kv_idx=kv_pos)
        return jnp.where(self.visible(j, kv_pos), s, -jnp.inf)

    def visible(self, j: Array, kv_pos: Array) -> Array:
        walk, mask = self.walk, self.mask
        active = (j < walk.num_blocks)[..., None, None]
        flags = walk.flags[..., j][..., None, None]
        computed = kv_pos < mask.kv_len
        if mask.mask_mod is not None:
            structured = mask.mask_mod.gather_leaves(self.b5, self.q_pos, kv_pos)
            computed &= structured.predicate(self.q_pos, kv_pos)
        stored = mask.partial_masks[jnp.maximum(walk.partial_ids[..., j], 0)]
        return (active & (((flags & COMPUTED) == 0) | computed)
                & (((flags & PARTIAL) == 0) | stored))

    # score_mod may capture integer arrays (index tables): only float ones are
    # differentiated; the others are merged back in by position.
    def float_captured(self) -> tuple[Array, ...]:
        return tuple(c for c in self.captured if jnp.issubdtype(c.dtype, jnp.inexact))

    def _merge_captured(self, float_captured: Sequence[Array]) -> tuple[Array, ...]:
        floats = iter(float_captured)
        return tuple(next(floats) if jnp.issubdtype(c.dtype, jnp.inexact) else c
                     for c in self.captured)


def _num_steps(mask: BlockMask) -> int | Array:
    """The walk's length: a Python int for a mask known at trace time, so that the loops
    are scans, which reverse-mode differentiates (gradients of gradients)."""
    counts = mask.kv_num_blocks
    return counts.max() if isinstance(counts, jax.core.Tracer) else int(np.asarray(counts).max())


def _log_normalizer(row_max: Array, row_sum: Array, sinks: Array | None) -> Array:
    """lse = log(sum_j exp(s_j) + exp(sink)) from the running max and sum."""
    seen = row_sum > 0
    lse = jnp.where(seen, row_max + jnp.log(jnp.where(seen, row_sum, 1)), -jnp.inf)
    if sinks is None:
        return lse
    return jnp.logaddexp(lse, sinks.astype(row_max.dtype)[None, :, None, None])


def attention_forward(problem: AttentionProblem, q: Array, k: Array, v: Array,
                      mask: BlockMask, sinks: Array | None,
                      captured: Sequence[Array]) -> tuple[Array, Array]:
    block_q, block_kv = mask.block_size
    dtype = _compute_dtype(q.dtype)
    q_blocks = _to_blocks(q, block_q)
    k_blocks, v_blocks = _to_blocks(k, block_kv), _to_blocks(v, block_kv)
    walk = _Walk.of(mask, problem.batch, problem.num_q_heads)
    tiles = _Tiles(problem, mask, walk, captured)
    float_captured = tiles.float_captured()

    def step(j, carry):
        row_max, row_sum, acc = carry
        kv_block = tiles.kv_block(j)
        s = tiles.scores(j, q_blocks, tiles.gather(k_blocks, kv_block), float_captured)
        new_max = jnp.maximum(row_max, s.max(axis=-1))
        shift = jnp.where(new_max == -jnp.inf, 0, new_max)  # Rows with nothing visible yet.
        p = jnp.exp(s - shift[..., None])
        alpha = jnp.exp(row_max - shift)
        v_tile = tiles.gather(v_blocks, kv_block).astype(dtype)
        pv = jnp.einsum("bhnqk,bhnkd->bhnqd", p, v_tile, precision=_HIGHEST)
        return new_max, alpha * row_sum + p.sum(axis=-1), alpha[..., None] * acc + pv

    rows = q_blocks.shape[:4]
    init = (jnp.full(rows, -jnp.inf, dtype), jnp.zeros(rows, dtype),
            jnp.zeros((*rows, problem.head_dim_v), dtype))
    init = compat.vary(init, compat.varying_axes(q, k, v, mask, captured))  # In shard_map.
    row_max, row_sum, acc = jax.lax.fori_loop(0, _num_steps(mask), step, init)
    lse = _log_normalizer(row_max, row_sum, sinks)
    seen = row_sum > 0
    weight = jnp.where(seen, jnp.exp(row_max - jnp.where(seen, lse, 0)), 0)
    out = _from_blocks(acc * weight[..., None], problem.q_len).astype(q.dtype)
    lse = lse.reshape(*lse.shape[:2], -1)[..., :problem.q_len]
    return out, lse


def attention_backward(problem: AttentionProblem, q: Array, k: Array, v: Array,
                       mask: BlockMask, sinks: Array | None, captured: Sequence[Array],
                       out: Array, lse: Array, dout: Array, dlse: Array):
    block_q, block_kv = mask.block_size
    dtype = _compute_dtype(q.dtype)
    q_blocks, do_blocks = _to_blocks(q, block_q), _to_blocks(dout, block_q).astype(dtype)
    k_blocks, v_blocks = _to_blocks(k, block_kv), _to_blocks(v, block_kv)
    # Probabilities p = exp(s - lse). A query that sees nothing has s = lse = -inf:
    # shift by 0 there instead. Padding rows get lse = +inf, so p = 0.
    lse = lse.astype(dtype)
    lse_blocks = _rows_to_blocks(jnp.where(lse == -jnp.inf, 0, lse), block_q, jnp.inf)
    # delta_i = rowsum(dO_i * O_i) - dlse_i: the lse cotangent folds into the softmax VJP.
    delta = (do_blocks * _to_blocks(out, block_q).astype(dtype)).sum(axis=-1)
    delta -= _rows_to_blocks(dlse.astype(dtype), block_q)
    walk = _Walk.of(mask, problem.batch, problem.num_q_heads)
    tiles = _Tiles(problem, mask, walk, captured)
    float_captured = tiles.float_captured()
    num_kv_blocks = k_blocks.shape[2]

    def step(j, carry):
        dq, dk, dv, dcaptured = carry
        kv_block = tiles.kv_block(j)
        k_tile = tiles.gather(k_blocks, kv_block)
        v_tile = tiles.gather(v_blocks, kv_block).astype(dtype)
        s, scores_vjp = jax.vjp(lambda qb, kt, fc: tiles.scores(j, qb, kt, fc), q_blocks,
                                k_tile, float_captured)
        p = jnp.exp(s - lse_blocks[..., None])
        dp = jnp.einsum("bhnqd,bhnkd->bhnqk", do_blocks, v_tile, precision=_HIGHEST)
        ds = p * (dp - delta[..., None])
        dq_step, dk_step, dcaptured_step = scores_vjp(ds.astype(s.dtype))
        dv_step = jnp.einsum("bhnqk,bhnqd->bhnkd", p, do_blocks, precision=_HIGHEST)
        index = (tiles.batch_idx, tiles.head_idx, kv_block)
        dk = dk.at[index].add(dk_step.astype(dtype))
        dv = dv.at[index].add(dv_step)
        dcaptured = tuple(a + b.astype(a.dtype) for a, b in zip(dcaptured, dcaptured_step,
                                                                 strict=True))
        return dq + dq_step.astype(dtype), dk, dv, dcaptured

    kv_shape = (problem.batch, problem.num_q_heads, num_kv_blocks, block_kv)
    init = (jnp.zeros(q_blocks.shape, dtype), jnp.zeros((*kv_shape, problem.head_dim), dtype),
            jnp.zeros((*kv_shape, problem.head_dim_v), dtype),
            tuple(jnp.zeros(c.shape, dtype) for c in float_captured))
    init = compat.vary(init, compat.varying_axes(q, k, v, mask, captured, dout, dlse))
    dq, dk, dv, dfloat = jax.lax.fori_loop(0, _num_steps(mask), step, init)

    def sum_groups(x):  # Per-q-head dK/dV summed into their kv head.
        b, _, n, blk, d = x.shape
        return x.reshape(b, problem.num_kv_heads, problem.group_size, n, blk, d).sum(axis=2)

    dk = _from_blocks(sum_groups(dk), problem.kv_len).astype(k.dtype)
    dv = _from_blocks(sum_groups(dv), problem.kv_len).astype(v.dtype)
    dq = _from_blocks(dq, problem.q_len).astype(q.dtype)
    dsinks = None
    if sinks is not None:
        sink_prob = jnp.exp(sinks.astype(dtype)[None, :, None, None] - lse_blocks)
        dsinks = -(sink_prob * delta).sum(axis=(0, 2, 3)).astype(sinks.dtype)
    dfloat = iter(dfloat)
    dcaptured = tuple(next(dfloat).astype(c.dtype) if jnp.issubdtype(c.dtype, jnp.inexact)
                      else zero_cotangent(c) for c in captured)
    return dq, dk, dv, dsinks, dcaptured


class XlaBackend(AttentionBackend):
    """Pure JAX; serves every call on every device."""

    name = "xla"

    def unavailable_reason(self):
        return None

    def unsupported_reason(self, problem):
        return None

    def block_size(self, problem):
        fit = lambda length: min(128, -(-length // 8) * 8)
        return fit(problem.q_len), fit(problem.kv_len)

    def forward(self, problem, q, k, v, block_mask, sinks, captured):
        return attention_forward(problem, q, k, v, block_mask, sinks, captured)

    def backward(self, problem, q, k, v, block_mask, sinks, captured, out, lse, dout, dlse):
        return attention_backward(problem, q, k, v, block_mask, sinks, captured, out, lse,
                                  dout, dlse)


def captured_cotangents(problem: AttentionProblem, q: Array, k: Array, v: Array,
                        block_mask: BlockMask, sinks: Array | None, captured: Sequence[Array],
                        out: Array, lse: Array, dout: Array, dlse: Array) -> tuple:
    """Cotangents of the score_mod's captured arrays, for kernels that compute the rest.

    Only float captured arrays have nonzero ones; the kernels do not reduce them,
    so this backward computes them. XLA discards its other outputs as dead code,
    and all of it when no gradient of these arrays is used (ALiBi slopes held
    constant, say).
    """
    if not any(jnp.issubdtype(c.dtype, jnp.inexact) for c in captured):
        return tuple(zero_cotangent(c) for c in captured)
    return attention_backward(problem, q, k, v, block_mask, sinks, captured, out, lse, dout,
                              dlse)[4]

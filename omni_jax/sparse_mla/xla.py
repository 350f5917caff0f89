"""Portable sparse MLA prefill in plain JAX: blockwise online softmax over topk.

Used on every platform where the SM90 FFI kernel cannot run, and as the backward
pass of the op everywhere. Work proceeds in blocks of ``TOPK_BLOCK`` listed kv rows
so live memory is O(s_q * block * d), never O(s_q * topk * d).

Conventions shared with the CUDA kernel:
  * ``scores`` are the raw dot products q . kv[index] in float32, -inf at invalid
    indices (index < 0 or index >= s_kv);
  * the softmax runs over ``sm_scale * scores``; ``lse`` and ``max_logits`` are in
    that scaled (natural-log) space;
  * duplicate indices are separate entries: a kv row listed twice counts twice;
  * invalid indices read zeros, never a kv row, so a non-finite row that only
    invalid indices point at does not reach any result or gradient;
  * a row without any valid index yields out = 0 and lse = max_logits = -inf.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from pallas_kernels import compat

TOPK_BLOCK = 64
_HIGHEST = jax.lax.Precision.HIGHEST


class ForwardResult(NamedTuple):
    out: jax.Array
    max_logits: jax.Array
    lse: jax.Array
    scores: jax.Array | None


def _topk_blocks(indices: jax.Array, s_kv: int) -> tuple[jax.Array, jax.Array, int]:
    """Splits [s_q, topk] indices into [n_blocks, s_q, block] and a validity mask.

    topk is padded with invalid entries (-1) up to a multiple of the block size.
    """
    s_q, topk = indices.shape
    block = min(TOPK_BLOCK, topk)
    padded = -(-topk // block) * block
    if padded != topk:
        indices = jnp.pad(indices, ((0, 0), (0, padded - topk)), constant_values=-1)
    blocks = indices.reshape(s_q, padded // block, block).transpose(1, 0, 2)
    valid = (blocks >= 0) & (blocks < s_kv)
    return blocks, valid, padded


def _gather_rows(kv: jax.Array, block_indices: jax.Array, valid: jax.Array) -> jax.Array:
    """kv rows [s_q, block, d] for one topk block, zeros for invalid indices.

    Zeros, not a stand-in row: a zero probability times a non-finite stand-in value
    would still be NaN. Invalid indices are sent out of range, which the gather fills.
    """
    out_of_range = jnp.where(valid, block_indices, kv.shape[0])
    return jnp.take(kv, out_of_range, axis=0, mode="fill", fill_value=0)


def _raw_scores(q32: jax.Array, rows: jax.Array, valid: jax.Array) -> jax.Array:
    """q . kv[index] as [s_q, h_q, block] float32, -inf where the index is invalid."""
    scores = jnp.einsum("qhd,qkd->qhk", q32, rows.astype(jnp.float32), precision=_HIGHEST)
    return jnp.where(valid[:, None, :], scores, -jnp.inf)


def forward(
    q: jax.Array,
    kv: jax.Array,
    indices: jax.Array,
    *,
    sm_scale: float,
    d_v: int,
    return_scores: bool,
) -> ForwardResult:
    """Sparse MLA prefill forward. Shapes: q [s_q,h_q,d], kv [s_kv,d], indices [s_q,topk]."""
    s_q, h_q, _ = q.shape
    topk = indices.shape[-1]
    blocks, valid, padded_topk = _topk_blocks(indices, kv.shape[0])
    q32 = q.astype(jnp.float32)

    def step(carry, block):
        running_max, running_sum, acc = carry
        block_indices, block_valid = block
        rows = _gather_rows(kv, block_indices, block_valid)
        scores = _raw_scores(q32, rows, block_valid)
        logits = scores * sm_scale
        new_max = jnp.maximum(running_max, logits.max(axis=-1))
        # A row whose entries so far are all invalid keeps max -inf; shifting by 0
        # instead keeps exp() at exact zeros rather than NaN.
        shift = jnp.where(jnp.isneginf(new_max), 0.0, new_max)
        probs = jnp.exp(logits - shift[..., None])
        rescale = jnp.exp(running_max - shift)
        values = rows[..., :d_v].astype(jnp.float32)
        acc = acc * rescale[..., None] + jnp.einsum(
            "qhk,qkv->qhv", probs, values, precision=_HIGHEST
        )
        running_sum = running_sum * rescale + probs.sum(axis=-1)
        return (new_max, running_sum, acc), (scores if return_scores else None)

    init = (
        jnp.full((s_q, h_q), -jnp.inf, jnp.float32),
        jnp.zeros((s_q, h_q), jnp.float32),
        jnp.zeros((s_q, h_q, d_v), jnp.float32),
    )
    init = compat.vary(init, compat.varying_axes(q, kv, indices))  # In a jax.shard_map.
    (max_logits, row_sum, acc), block_scores = jax.lax.scan(step, init, (blocks, valid))

    has_valid = row_sum > 0
    out = acc / jnp.where(has_valid, row_sum, 1.0)[..., None]
    lse = jnp.where(has_valid, max_logits + jnp.log(jnp.where(has_valid, row_sum, 1.0)), -jnp.inf)
    max_logits = jnp.where(has_valid, max_logits, -jnp.inf)

    scores = None
    if return_scores:
        # [n_blocks, s_q, h_q, block] -> [s_q, h_q, topk]
        scores = block_scores.transpose(1, 2, 0, 3).reshape(s_q, h_q, padded_topk)[..., :topk]
    return ForwardResult(out.astype(q.dtype), max_logits, lse, scores)


def backward(
    q: jax.Array,
    kv: jax.Array,
    indices: jax.Array,
    out: jax.Array,
    lse: jax.Array,
    d_out: jax.Array,
    d_lse: jax.Array | None,
    d_scores: jax.Array | None,
    *,
    sm_scale: float,
    d_v: int,
) -> tuple[jax.Array, jax.Array]:
    """(dq, dkv) of the forward above, recomputing probabilities blockwise from lse.

    Cotangents: ``d_out`` of out, ``d_lse`` of lse and ``d_scores`` of the raw scores
    (None when zero). max_logits is treated as non-differentiable.
    """
    s_q, h_q, d_qk = q.shape
    s_kv = kv.shape[0]
    topk = indices.shape[-1]
    blocks, valid, padded_topk = _topk_blocks(indices, s_kv)
    n_blocks = blocks.shape[0]
    block = blocks.shape[-1]
    q32 = q.astype(jnp.float32)
    d_out32 = d_out.astype(jnp.float32)
    # d(loss)/d(logit_k) = p_k * (dp_k - delta + d_lse), with delta = sum(dout * out).
    delta = jnp.einsum("qhv,qhv->qh", d_out32, out.astype(jnp.float32), precision=_HIGHEST)
    if d_lse is not None:
        delta = delta - jnp.where(jnp.isneginf(lse), 0.0, d_lse)
    lse_shift = jnp.where(jnp.isneginf(lse), 0.0, lse)
    if d_scores is not None:
        pad = padded_topk - topk
        d_scores = jnp.pad(d_scores.astype(jnp.float32), ((0, 0), (0, 0), (0, pad)))
        d_scores_blocks = d_scores.reshape(s_q, h_q, n_blocks, block).transpose(2, 0, 1, 3)
    else:
        d_scores_blocks = jnp.zeros((n_blocks, 0), jnp.float32)

    def step(carry, block_inputs):
        dq, dkv = carry
        block_indices, block_valid, block_d_scores = block_inputs
        rows = _gather_rows(kv, block_indices, block_valid)
        rows32 = rows.astype(jnp.float32)
        scores = _raw_scores(q32, rows, block_valid)
        probs = jnp.exp(scores * sm_scale - lse_shift[..., None])
        d_probs = jnp.einsum("qhv,qkv->qhk", d_out32, rows32[..., :d_v], precision=_HIGHEST)
        d_raw = sm_scale * probs * (d_probs - delta[..., None])
        if d_scores is not None:
            d_raw = d_raw + jnp.where(block_valid[:, None, :], block_d_scores, 0.0)
        dq = dq + jnp.einsum("qhk,qkd->qhd", d_raw, rows32, precision=_HIGHEST)
        d_rows = jnp.einsum("qhk,qhd->qkd", d_raw, q32, precision=_HIGHEST)
        d_rows = d_rows.at[..., :d_v].add(
            jnp.einsum("qhk,qhv->qkv", probs, d_out32, precision=_HIGHEST)
        )
        # Invalid entries get an out-of-range target and are dropped by the scatter.
        targets = jnp.where(block_valid, block_indices, s_kv).reshape(-1)
        dkv = dkv.at[targets].add(d_rows.reshape(-1, d_qk), mode="drop")
        return (dq, dkv), None

    init = (jnp.zeros((s_q, h_q, d_qk), jnp.float32), jnp.zeros((s_kv, d_qk), jnp.float32))
    init = compat.vary(init, compat.varying_axes(q, kv, indices, d_out, d_lse, d_scores))
    (dq, dkv), _ = jax.lax.scan(step, init, (blocks, valid, d_scores_blocks))
    return dq.astype(q.dtype), dkv.astype(kv.dtype)

"""Float64 references for sparse MLA prefill: a numpy loop and a dense jax formulation."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


def reference_forward(q, kv, indices, *, sm_scale, d_v):
    """(out, max_logits, lse, scores) in float64 numpy, one query row at a time."""
    q = np.asarray(q, np.float64)
    kv = np.asarray(kv, np.float64)[:, 0]
    indices = np.asarray(indices)[:, 0]
    s_q, h_q, _ = q.shape
    topk = indices.shape[-1]
    out = np.zeros((s_q, h_q, d_v))
    max_logits = np.full((s_q, h_q), -np.inf)
    lse = np.full((s_q, h_q), -np.inf)
    scores = np.full((s_q, h_q, topk), -np.inf)
    for s in range(s_q):
        valid = (indices[s] >= 0) & (indices[s] < kv.shape[0])
        if not valid.any():
            continue
        rows = kv[indices[s][valid]]
        raw = q[s] @ rows.T
        scores[s][:, valid] = raw
        logits = raw * sm_scale
        m = logits.max(axis=-1)
        p = np.exp(logits - m[:, None])
        total = p.sum(axis=-1)
        out[s] = (p @ rows[:, :d_v]) / total[:, None]
        max_logits[s] = m
        lse[s] = m + np.log(total)
    return out, max_logits, lse, scores


def dense_loss_fn(indices, *, sm_scale, d_v, weights):
    """loss(q, kv) = <out, w_out> + <lse, w_lse> + <scores, w_scores>, dense over topk.

    Call under ``jax.enable_x64`` with float64 inputs for a float64 gradient reference.
    """
    indices = jnp.asarray(indices)[:, 0]
    w_out, w_lse, w_scores = weights

    def loss(q, kv):
        kv = kv[:, 0]
        valid = (indices >= 0) & (indices < kv.shape[0])
        # Invalid entries read zeros, never a real row (it may be non-finite).
        rows = jnp.where(valid[..., None], kv[jnp.where(valid, indices, 0)], 0.0)
        raw = jnp.einsum("qhd,qkd->qhk", q, rows)
        logits = jnp.where(valid[:, None], raw * sm_scale, -jnp.inf)
        any_valid = valid.any(axis=-1)[:, None]
        safe_logits = jnp.where(any_valid[..., None], logits, 0.0)
        lse = jax.nn.logsumexp(safe_logits, axis=-1)
        p = jnp.exp(safe_logits - lse[..., None]) * any_valid[..., None]
        out = jnp.einsum("qhk,qkv->qhv", p, rows[..., :d_v])
        total = jnp.sum(out * w_out) + jnp.sum(jnp.where(any_valid, lse, 0.0) * w_lse)
        return total + jnp.sum(jnp.where(valid[:, None], raw, 0.0) * w_scores)

    return loss

"""`paged_attention`: attention of each sequence's newest queries over its paged KV cache."""

from __future__ import annotations

import functools
import math
from typing import Any

import jax
import jax.numpy as jnp

from omni_jax import validation as common
from omni_jax.masks.mask_mods import INT32_MAX
from omni_jax.paged import backends, validation
from pallas_kernels import runtime
from pallas_kernels.paged import PagedScores
from pallas_kernels.softmax import fold_sinks

Array = Any


def paged_attention(q: Array, k_pages: Array, v_pages: Array, page_table: Array,
                    kv_lens: Array, *, is_causal: bool = True,
                    local_window_size: int | tuple[int, int] | None = None,
                    softcap: float | None = None, sinks: Array | None = None,
                    scale: float | None = None, return_lse: bool = False,
                    implementation: str | None = None) -> Array | tuple[Array, Array]:
    """Attention of the last ``q_len`` tokens of each sequence over its paged KV cache.

    Args:
      q: ``[batch, q_len, num_heads, head_dim]``: query ``t`` of sequence ``b`` is its
        token at position ``kv_lens[b] - q_len + t`` (q_len 1: a decoding step; more: a
        chunk of a prefill whose keys are already in the cache).
      k_pages, v_pages: ``[num_pages, page_size, num_kv_heads, head_dim(_v)]``, shared
        by all sequences; ``num_heads`` is a multiple of ``num_kv_heads`` (GQA/MQA).
        Read, never written (see `paged_cache_write`).
      page_table: int32 ``[batch, pages_per_seq]``: token ``i`` of sequence ``b`` is row
        ``i % page_size`` of page ``page_table[b, i // page_size]``.
      kv_lens: int32 ``[batch]`` tokens in each sequence's cache (0 allowed).
      is_causal: query at position p sees keys at positions <= p (bottom-right aligned).
      local_window_size: ``(left, right)`` (or one int for both): keys within
        ``[p - left, p + right]`` of the query's position p.
      softcap: ``softcap * tanh(score / softcap)``.
      sinks: float ``[num_heads]`` logits that join each softmax denominator only.
      scale: score scale, default ``1 / sqrt(head_dim)``.
      return_lse: also return the natural-log log-sum-exp ``[batch, num_heads, q_len]``
        (float32; float64 for float64 inputs), sinks included.
      implementation: None (best available), "xla", "triton" or "mosaic".

    Returns ``out [batch, q_len, num_heads, head_dim_v]`` in q's dtype, or ``(out, lse)``.
    A query that sees no key (kv_lens 0) gets zeros and lse -inf (its sink logit with
    sinks). Outside ``jit``, lengths past the table's pages and page ids outside the
    cache for tokens in use raise; under ``jit`` such keys are masked and no read
    leaves ``k_pages``/``v_pages``. There is no derivative: this serves inference, and
    ``jax.grad``/``jax.jvp`` through it raise.
    """
    page_table, kv_lens = validation.check_cache(k_pages, v_pages, page_table, kv_lens)
    batch = page_table.shape[0]
    validation.check_query(q, k_pages, v_pages, batch)
    num_pages, page_size = k_pages.shape[:2]
    validation.check_lengths(page_table, kv_lens, num_pages=num_pages, page_size=page_size)
    is_causal = common.check_flag("is_causal", is_causal)
    return_lse = common.check_flag("return_lse", return_lse)
    window = common.check_window(local_window_size)
    if window is not None:  # wider than any cache: as wide as int32 positions reach
        window = (min(window[0], INT32_MAX), min(window[1], INT32_MAX))
    softcap = common.check_scalar("softcap", softcap, positive=True)
    scale = common.check_scalar("scale", scale, positive=False)
    sinks = common.check_sinks(sinks, q.shape[2])
    common.check_implementation(implementation)
    q_len, head_dim = q.shape[1], q.shape[3]
    scores = PagedScores(q_len=q_len, is_causal=is_causal, window=window, softcap=softcap,
                         scale=1.0 / math.sqrt(head_dim) if scale is None else scale)
    problem = backends.PagedProblem(jnp.dtype(q.dtype), head_dim, v_pages.shape[3], page_size,
                                    page_table.shape[1], batch=batch, q_len=q_len,
                                    num_kv_heads=k_pages.shape[2],
                                    group=q.shape[2] // k_pages.shape[2])
    name = backends.choose(implementation, problem)
    if not (batch and q_len and num_pages and page_table.shape[1]):
        out, lse = _nothing_to_attend(q, v_pages)
    else:
        static = (name, scores, runtime.interpret_requested())
        out, lse = _paged(static, q, k_pages, v_pages, page_table, kv_lens)
    if sinks is not None:
        out, lse = fold_sinks(out, lse, sinks)
    return (out, lse) if return_lse else out


def _nothing_to_attend(q: Array, v_pages: Array) -> tuple[Array, Array]:
    batch, q_len, num_heads, _ = q.shape
    lse_dtype = jnp.promote_types(q.dtype, jnp.float32)
    return (jnp.zeros((batch, q_len, num_heads, v_pages.shape[3]), q.dtype),
            jnp.full((batch, num_heads, q_len), -jnp.inf, lse_dtype))


@functools.partial(jax.custom_jvp, nondiff_argnums=(0,))
def _paged_forward(static: tuple, q, k_pages, v_pages, page_table, kv_lens):
    name, scores, interpret = static
    return backends.forward(name, q, k_pages, v_pages, page_table, kv_lens, scores,
                            interpret=interpret)


@_paged_forward.defjvp
def _no_derivative(static, primals, tangents):
    raise NotImplementedError(
        "omni_jax.paged_attention has no derivative (it serves inference: decoding and "
        "chunked prefill over a paged cache); differentiate omni_jax.attention on a "
        "contiguous cache instead, or stop the gradient (jax.lax.stop_gradient) before it")


@functools.partial(jax.jit, static_argnums=(0,))
def _paged(static: tuple, q, k_pages, v_pages, page_table, kv_lens):
    """One compile per (implementation, scores, interpret mode) and shapes, eager calls
    included."""
    return _paged_forward(static, q, k_pages, v_pages, page_table, kv_lens)

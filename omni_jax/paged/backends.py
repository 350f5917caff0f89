"""Which implementation computes a paged-attention call, and how each is called.

``implementation=None`` takes the first of the device's preference order
(`pallas_kernels.runtime.implementation_preference`: on Hopper "mosaic", "triton",
"xla"; Triton first for decoding steps over short caches, `SHORT_CACHE_TOKENS`) that
serves the call; "xla" serves every call. Each implementation returns the sink-free
``(out, lse)`` of the grouped-query layout the API passes in.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping
from typing import Any

import jax.numpy as jnp

from omni_jax import query_groups
from omni_jax.dispatch_log import log_once, warn_xla_on_a_gpu
from omni_jax.paged import mosaic
from omni_jax.paged.xla import paged_attention_xla
from pallas_kernels import runtime
from pallas_kernels.paged import PagedScores
from pallas_kernels.triton import paged_attention as triton_paged

logger = logging.getLogger("omni_jax.paged")
Array = Any


# Decoding steps (one query a sequence) whose page table holds at most this many tokens
# go to the Triton kernel before the Mosaic one: their CTAs walk one to eight kv tiles,
# so a step's time is each CTA's latency (page-table row, first loads), which the Triton
# kernel's several programs an SM overlap and the Mosaic kernel's one CTA an SM cannot.
# H100, 2026-12-07 (benchmarks/RESULTS.md), GQA 32/8, d128: caches of 256-1024 tokens
# 0-28% faster under Triton (256 x 256 ragged 0.092 against 0.118 ms, 256 x 512 ragged
# 0.154-0.173 against 0.173-0.190), 2048 tokens 0-5% slower; from 4096 the Mosaic
# kernel is even or ahead (H200, 2026-11-28: 32 x 16384 10% ahead).
SHORT_CACHE_TOKENS = 1024


@dataclasses.dataclass(frozen=True)
class PagedProblem:
    """The static description of one call: what decides who serves it."""

    dtype: Any
    head_dim: int
    head_dim_v: int
    page_size: int
    pages_per_seq: int
    batch: int = 1
    q_len: int = 1
    num_kv_heads: int = 1
    group: int = 1  # query heads per kv head

    @property
    def short_decoding_step(self) -> bool:
        """A decoding step over a page table of at most `SHORT_CACHE_TOKENS` tokens."""
        return self.q_len == 1 and self.page_size * self.pages_per_seq <= SHORT_CACHE_TOKENS


def unsupported_reason(name: str, problem: PagedProblem) -> str | None:
    """Why ``name`` cannot compute ``problem`` here, or None when it can."""
    if name == "xla":
        return None
    if name == "mosaic":
        return mosaic.unsupported_reason(problem.dtype, problem.head_dim, problem.head_dim_v,
                                         problem.page_size, problem.pages_per_seq)
    if not runtime.can_run_triton():
        return ("the Triton backend needs an NVIDIA GPU with compute capability >= 8.0 "
                f"(or {runtime.INTERPRET_ENV_VAR}=1 to run it interpreted)")
    return triton_paged.unsupported_reason(jnp.dtype(problem.dtype), problem.head_dim,
                                           problem.head_dim_v)


def _preference(problem: PagedProblem) -> tuple[str, ...]:
    """The device's order, Triton moved first for short decoding steps."""
    order = runtime.implementation_preference()
    if problem.short_decoding_step and "triton" in order:
        return ("triton", *(name for name in order if name != "triton"))
    return order


def choose(implementation: str | None, problem: PagedProblem) -> str:
    """The implementation that computes ``problem``; a named one that cannot raises."""
    if implementation is not None:
        reason = unsupported_reason(implementation, problem)
        if reason is not None:
            raise ValueError(f"implementation={implementation!r} cannot serve this "
                             f"paged_attention call: {reason}")
        return implementation
    declined = {}
    for name in (*_preference(problem), "xla"):
        reason = unsupported_reason(name, problem)
        if reason is None:
            break
        declined[name] = reason
    reasons = "; ".join(f"not {n}: {r}" for n, r in declined.items())
    if declined:
        log_once(logger, logging.DEBUG, f"paged_attention {problem}: {name!r} ({reasons})")
    if name == "xla" and declined:
        warn_xla_on_a_gpu("omni_jax.paged_attention runs on the XLA reference", str(problem),
                          declined)
    return name


def forward(name: str, q: Array, k_pages: Array, v_pages: Array, page_table: Array,
            kv_lens: Array, scores: PagedScores, *, interpret: bool,
            overrides: Mapping[str, int] | None = None) -> tuple[Array, Array]:
    """Sink-free (out ``[B, Sq, Hq, Dv]``, lse ``[B, Hq, Sq]``) by implementation ``name``.

    ``overrides``: fields of the kernel's config (Mosaic `ForwardConfig`, Triton
    `PagedConfig`) forced over its default choice, for benchmarks' A/B runs."""
    if name == "xla":
        return paged_attention_xla(q, k_pages, v_pages, page_table, kv_lens, scores)
    if name == "mosaic":
        return mosaic.paged_attention_mosaic(q, k_pages, v_pages, page_table, kv_lens, scores,
                                             overrides)
    group = q.shape[2] // k_pages.shape[2]
    packed = query_groups.pack_queries(q, group)
    config = None
    if overrides:
        config = triton_paged.choose_config(
            q.shape[0], packed.shape[1], k_pages.shape[2], page_table.shape[1],
            k_pages.shape[1], base=triton_paged.PagedConfig(**overrides))
    out, lse = triton_paged.paged_attention(
        packed, k_pages, v_pages, page_table, kv_lens, scores=scores, group=group,
        interpret=interpret, config=config)
    return query_groups.unpack(out, lse, group)

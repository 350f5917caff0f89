"""The portable Pallas backend: flash-attention kernels lowered through Triton (sm80+).

Kernels live in `pallas_kernels.triton`; this module only decides whether
they serve a problem, picks their configs and adapts the `BlockMask`.
``OMNI_JAX_PALLAS_INTERPRET=1`` runs them in Pallas interpret mode (any
device, CPU included), which is how CI tests them.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Hashable, Sequence

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from omni_jax.backends import xla
from omni_jax.backends.base import AttentionBackend
from omni_jax.problem import AttentionProblem
from omni_jax.scores import primitive_names
from pallas_kernels import compat, kv_splits, runtime
from pallas_kernels.block_sparse import MaskLayout, kernel_mask, walk_statistics
from pallas_kernels.captured import score_mod_on_refs
from pallas_kernels.score_pipeline import transform_scores
from pallas_kernels.softmax import sinks_cotangent
from pallas_kernels.triton import configs, tiles
from pallas_kernels.triton.attention_bwd import BackwardConfig, attention_backward
from pallas_kernels.triton.attention_fwd import ForwardConfig, attention_forward

_DTYPES = (jnp.bfloat16, jnp.float16, jnp.float32)
_MAX_MASK_BLOCK = 128


def _largest_power_of_two_divisor(n: int) -> int:
    return n & -n


@functools.lru_cache(maxsize=256)
def _score_mod_reason(problem: AttentionProblem) -> str | None:
    """Why the compiled kernels cannot apply ``problem``'s softcap/score_mod, or None.

    Traces the kernels' score transform of a tile, captured arrays read through refs
    as the kernels read them, and looks for operations the Triton lowering lacks
    (a captured array indexed per score by q_idx or kv_idx is a gather).
    """
    if problem.score_mod is None:
        return None
    lowerable = compat.triton_lowerable_primitives()
    if lowerable is None:
        return None
    score_mod = problem.score_mod
    q_idx = jnp.arange(16, dtype=jnp.int32)[:, None]
    kv_idx = jnp.arange(16, dtype=jnp.int32)[None, :]

    def tile_scores(scores, *captured):
        def transform(refs):
            *captured_refs, out_ref = refs
            mod = (score_mod_on_refs(score_mod, captured_refs, [c.shape for c in captured])
                   if captured else score_mod)
            out_ref[...] = transform_scores(scores, softcap=problem.softcap, score_mod=mod,
                                            captured=(), b=jnp.int32(0), h=jnp.int32(0),
                                            q_idx=q_idx, kv_idx=kv_idx)

        inputs = (*(jnp.atleast_1d(c) for c in captured), jnp.zeros_like(scores))
        return pl.run_state(transform)(inputs)[-1]

    captured = [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype)
                for v in score_mod.jaxpr.constvars]
    jaxpr = jax.make_jaxpr(tile_scores)(jax.ShapeDtypeStruct((16, 16), jnp.float32),
                                        *captured).jaxpr
    harness = {"run_state", "get", "swap"}  # ref reads and writes lower; run_state is ours
    missing = sorted(name for name in primitive_names(jaxpr) - harness
                     if name not in {p.name for p in lowerable})
    if missing:
        return f"score_mod uses operations the Triton lowering lacks: {', '.join(missing)}"
    return None


def _tune_key(problem: AttentionProblem):
    shapes = ((problem.batch, problem.q_len, problem.num_q_heads, problem.head_dim),
              (problem.batch, problem.kv_len, problem.num_kv_heads, problem.head_dim),
              (problem.batch, problem.kv_len, problem.num_kv_heads, problem.head_dim_v))
    return configs.problem_key(shapes, problem.dtype, problem.block_size)


def _default_block_size(q_len: int, kv_len: int) -> tuple[int, int]:
    fit = lambda length: min(_MAX_MASK_BLOCK, max(tiles.MIN_TILE, pl.next_power_of_2(length)))
    return fit(q_len), fit(kv_len)


def autotune(query, key, value, *, forward_candidates: Sequence[ForwardConfig] = (),
             backward_candidates: Sequence[BackwardConfig] = (),
             **attention_kwargs) -> tuple[ForwardConfig | None, BackwardConfig | None]:
    """Times candidate kernel configs on these inputs; later calls of these shapes use the winners.

    ``attention_kwargs`` are `omni_jax.attention`'s keyword arguments (masks,
    softcap, ...). Backward candidates are timed on forward + backward.
    Returns the (forward, backward) winners (None where there were no candidates).
    """
    from omni_jax.attention import attention

    mask = attention_kwargs.get("mask")
    block_size = (mask.block_size if mask is not None
                  else _default_block_size(query.shape[1], key.shape[1]))
    tune_key = configs.problem_key((query.shape, key.shape, value.shape), query.dtype,
                                   tuple(block_size))

    def forward(q, k, v):
        return attention(q, k, v, implementation="triton", **attention_kwargs)

    def forward_backward(q, k, v):
        out, vjp = jax.vjp(forward, q, k, v)
        return vjp(out)

    def build(kind, config):
        configs.set_tuned(kind, tune_key, config)  # Read at trace time: trace afresh.
        fn = forward if kind == "forward" else forward_backward
        # A new function object per candidate: jit would otherwise reuse the first trace.
        compiled = jax.jit(lambda q, k, v: fn(q, k, v)).lower(query, key, value).compile()
        return lambda: compiled(query, key, value)

    winners = []
    for kind, candidates in (("forward", forward_candidates), ("backward", backward_candidates)):
        winners.append(configs.autotune(kind, tune_key, candidates,
                                        functools.partial(build, kind)) if candidates else None)
    return winners[0], winners[1]


def _table_forward_config(problem: AttentionProblem) -> ForwardConfig:
    return configs.forward_config(max(problem.head_dim, problem.head_dim_v), problem.dtype,
                                  _tune_key(problem), problem.q_len)


def _forward_config(problem: AttentionProblem, layout: MaskLayout,
                    walk: float | None) -> ForwardConfig:
    """The forward's config; unless it fixes ``kv_splits``, as many splits as fill the
    SMs with the q tiles of ``problem`` walking ``walk`` kv-blocks on average (every
    kv-block when None: a traced mask)."""
    config = _table_forward_config(problem)
    if config.kv_splits is not None:
        return config
    tile_q = tiles.tile_size(config.block_q, layout.block_q)
    programs = problem.batch * problem.num_q_heads * pl.cdiv(problem.q_len, tile_q)
    splits = kv_splits.num_splits(programs, layout.num_kv_blocks if walk is None else walk,
                                  runtime.num_sms())
    return dataclasses.replace(config, kv_splits=splits)


class TritonBackend(AttentionBackend):
    """Pallas kernels with Triton lowering: forward, dK/dV and dQ, all block-sparse."""

    name = "triton"

    def unavailable_reason(self) -> str | None:
        if runtime.can_run_triton():
            return None
        return ("the Triton backend needs an NVIDIA GPU with compute capability >= 8.0 "
                f"(or {runtime.INTERPRET_ENV_VAR}=1 to run it interpreted)")

    def unsupported_reason(self, problem: AttentionProblem) -> str | None:
        if not any(problem.dtype == jnp.dtype(d) for d in _DTYPES):
            return f"dtype {problem.dtype} is not bfloat16, float16 or float32"
        for name, dim in (("head_dim", problem.head_dim), ("head_dim_v", problem.head_dim_v)):
            if dim > tiles.MAX_HEAD_DIM:
                return f"{name}={dim} exceeds {tiles.MAX_HEAD_DIM}"
        if problem.block_size is not None:
            for name, block in zip(("block_q", "block_kv"), problem.block_size, strict=True):
                if _largest_power_of_two_divisor(block) < tiles.MIN_TILE:
                    return (f"the BlockMask's {name}={block} is not a multiple of "
                            f"{tiles.MIN_TILE} (Triton tiles need >= {tiles.MIN_TILE} rows)")
        if runtime.interpret_requested():
            return None  # Interpreted kernels run any score_mod.
        return _score_mod_reason(problem)

    def block_size(self, problem: AttentionProblem) -> tuple[int, int]:
        return _default_block_size(problem.q_len, problem.kv_len)

    def trace_key(self, problem: AttentionProblem) -> Hashable:
        head_dim = max(problem.head_dim, problem.head_dim_v)
        return (_table_forward_config(problem),
                configs.backward_config(head_dim, problem.dtype, _tune_key(problem)),
                runtime.interpret_requested())

    def forward(self, problem, q, k, v, block_mask, sinks, captured):
        mask, layout = kernel_mask(block_mask)
        walk = walk_statistics(mask)
        config = _forward_config(problem, layout, None if walk is None else walk.mean_kv_blocks)
        return attention_forward(q, k, v, mask, layout, sinks, captured, scale=problem.scale,
                                 softcap=problem.softcap, score_mod=problem.score_mod,
                                 config=config, interpret=runtime.interpret_requested(),
                                 partial_tiles=problem.has_user_mask)

    def backward(self, problem, q, k, v, block_mask, sinks, captured, out, lse, dout, dlse):
        mask, layout = kernel_mask(block_mask)
        config = configs.backward_config(max(problem.head_dim, problem.head_dim_v),
                                         problem.dtype, _tune_key(problem))
        dq, dk, dv, delta = attention_backward(
            q, k, v, mask, layout, captured, out, lse, dout, dlse, scale=problem.scale,
            softcap=problem.softcap, score_mod=problem.score_mod, config=config,
            interpret=runtime.interpret_requested(), partial_tiles=problem.has_user_mask)
        dsinks = None if sinks is None else sinks_cotangent(sinks, lse, delta)
        return dq, dk, dv, dsinks, xla.captured_cotangents(
            problem, q, k, v, block_mask, sinks, captured, out, lse, dout, dlse)

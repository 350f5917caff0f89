"""Block-sparse flash-attention forward pass, Pallas with Triton lowering (sm80+).

One program per (q tile, query head, batch). It keeps its q tile in
registers and walks only the active kv tiles of its q block in the
BlockMask (skipped tiles cost nothing), with an online softmax in float32
and ``exp2`` (log2(e) folded into the scale). FULL tiles (walked first, in a
loop of their own) do no mask math;
COMPUTED tiles evaluate the structured mask from indices, PARTIAL tiles
read their stored tile. K/V tiles come straight from HBM inside the loop,
which Triton software-pipelines over ``num_stages`` buffers. Sequence tails and
head dims below a power of two are masked in the loads and stores, not padded.

Outputs: ``out`` and ``lse`` (natural log, float32, sinks included; -inf for
a query that sees no key and has no sink).

With ``ForwardConfig.kv_splits`` > 1 (calls with fewer q tiles than SMs, decoding
steps) each q tile's walk is cut into that many even shares, one program each
(`pallas_kernels.kv_splits`); each writes a float32 output normalised over its own
keys and their lse, and the wrapper combines them, then adds the sinks.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from typing import Any

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels import compat, kv_splits
from pallas_kernels.block_sparse import KernelMask, MaskLayout
from pallas_kernels.score_pipeline import ConvertedScoreMod
from pallas_kernels.softmax import fold_sinks
from pallas_kernels.triton import tiles

Array = Any


@dataclasses.dataclass(frozen=True)
class ForwardConfig:
    """Tile sizes and launch parameters of the forward kernel.

    ``block_q``/``block_kv`` are upper bounds: the kernel uses the largest
    power of two <= them that divides the mask's block size.
    """

    block_q: int = 128
    block_kv: int = 64
    num_warps: int = 4
    num_stages: int = 2
    # Programs per q tile, each walking an even share of its kv tiles; None: the
    # backend picks enough to fill the GPU's SMs (`pallas_kernels.kv_splits`).
    kv_splits: int | None = None

    def __post_init__(self):
        if self.kv_splits is not None and self.kv_splits < 1:
            raise ValueError(f"kv_splits must be None or >= 1; got {self.kv_splits}")


def _forward_kernel(*refs: Any, treedef: Any, spec: tiles.ScoreSpec, num_q_tiles: int,
                    group: int, splits: int, has_sinks: bool) -> None:
    inputs, (out_ref, lse_ref) = tiles.unpack_refs(refs, treedef)
    layout = spec.layout
    tq, tkv = spec.tile_q, spec.tile_kv
    # Heaviest q tiles (last rows of causal masks) first: shorter tail.
    q_tile = num_q_tiles - 1 - pl.program_id(0)
    h = pl.program_id(1)
    b, split = lax.div(pl.program_id(2), splits), lax.rem(pl.program_id(2), splits)
    kv_head = lax.div(h, group)
    q_start = q_tile * tq
    q = tiles.load_operand(inputs, layout, "q", b, q_start, tq, h)
    mask = inputs["mask"]
    walk = tiles.Walk(mask.kv_walk, b, h, lax.div(q_start, layout.block_q),
                      layout.block_kv // tkv, contiguous_full=layout.contiguous_full)

    # Plain scores stay raw until the softmax, which folds the scale into the exp2
    # argument (one FMA per score); the row max is scaled per row.
    def to_log2(x):
        return x * spec.exp2_scale if spec.folds_scale else x

    def body(step, carry):
        acc, row_max, row_sum = carry
        kv_start = step.block * layout.block_kv + step.sub * tkv
        k = tiles.load_operand(inputs, layout, "k", b, kv_start, tkv, kv_head)
        scores = tiles.TileScores(spec, mask, inputs["captured"], b, h, q_start, kv_start)
        qk = tiles.dot_nt(q, k)
        s = scores.softmax_scores(qk)[0]
        s = scores.masked(s, step)
        new_max = jnp.maximum(row_max, to_log2(s.max(axis=1)))
        # Rows with nothing visible yet keep max -inf: shift by 0 so exp2 gives 0, not NaN.
        shift = jnp.where(new_max == -jnp.inf, 0.0, new_max)
        p = tiles.exp2(s, shift, scale=spec.exp2_scale, ptx=spec.ptx)
        alpha = tiles.exp2(row_max, shift, scale=1.0, ptx=spec.ptx)
        v = tiles.load_operand(inputs, layout, "v", b, kv_start, tkv, kv_head)
        acc = acc * alpha[:, None] + tiles.dot_nn(p.astype(v.dtype), v)
        return acc, new_max, row_sum * alpha + p.sum(axis=1)

    init = (jnp.zeros((tq, tiles.padded_head_dim(inputs["v"].shape[3])), jnp.float32),
            jnp.full((tq,), -jnp.inf, jnp.float32), jnp.zeros((tq,), jnp.float32))
    acc, row_max, row_sum = walk.fold(body, init, spec.masked_tiles, split, splits)

    if has_sinks:
        # The sink joins the denominator: renormalise to max(row_max, sink) first. A -inf
        # sink on a row that saw no key leaves that at -inf: shift by 0, as the walk does.
        sink = inputs["sinks"][h] * tiles.LOG2E
        final_max = jnp.maximum(row_max, sink)
        shift = jnp.where(final_max == -jnp.inf, 0.0, final_max)
        alpha = jnp.exp2(row_max - shift)
        row_sum = row_sum * alpha + jnp.exp2(sink - shift)
        acc = acc * alpha[:, None]
        row_max = shift
    seen = row_sum > 0
    safe_sum = jnp.where(seen, row_sum, 1.0)
    lse2 = jnp.where(seen, row_max + jnp.log2(safe_sum), -jnp.inf)
    inv = jnp.where(seen, 1.0 / safe_sum, 0.0)
    q_len = inputs["q"].shape[1]
    tiles.store_rows(out_ref, (acc * inv[:, None]).astype(out_ref.dtype), q_start,
                     length=q_len, dim=inputs["v"].shape[3])
    tiles.store_rows(lse_ref, lse2 * tiles.LN2, q_start, length=q_len)


def attention_forward(q: Array, k: Array, v: Array, mask: KernelMask, layout: MaskLayout,
                      sinks: Array | None, captured: Sequence[Array], *, scale: float,
                      softcap: float | None, score_mod: ConvertedScoreMod | None,
                      config: ForwardConfig, interpret: bool,
                      partial_tiles: bool = True) -> tuple[Array, Array]:
    """(out ``[B, Sq, Hq, Dv]``, lse ``[B, Hq, Sq]`` float32) of block-sparse attention.

    ``mask``/``layout`` come from `pallas_kernels.block_sparse.kernel_mask`;
    ``captured`` holds the score_mod's captured arrays. ``partial_tiles=False``
    promises the mask holds no PARTIAL tiles (so no stored-tile code is compiled).
    """
    batch, q_len, num_heads, head_dim = q.shape
    num_kv_heads, head_dim_v = k.shape[2], v.shape[3]
    spec = tiles.ScoreSpec(layout, tiles.tile_size(config.block_q, layout.block_q),
                           tiles.tile_size(config.block_kv, layout.block_kv), scale, softcap,
                           score_mod, tuple(jnp.shape(c) for c in captured), partial_tiles,
                           ptx=tiles.inline_ptx(interpret))
    dim_v = tiles.padded_head_dim(head_dim_v)
    splits = config.kv_splits or 1
    sinks_in_kernel = sinks is not None and splits == 1  # split walks add them after the combine
    operands = {
        "q": q,
        "k": k,
        "v": v,
        "mask": tiles.mask_operands(mask, layout, q_walk=False, kv_walk=True,
                                    partial_tiles=partial_tiles),
        "sinks": sinks.astype(jnp.float32) if sinks_in_kernel else None,
        "captured": [jnp.atleast_1d(c) for c in captured],
    }
    flat, treedef = tiles.pack_operands(operands)
    # Tiles that hold a query row; the last one's output block overhangs the arrays
    # (rows past q_len, columns past head_dim_v are not written).
    num_q_tiles = pl.cdiv(q_len, spec.tile_q)
    last = num_q_tiles - 1
    kernel = functools.partial(_forward_kernel, treedef=treedef, spec=spec,
                               num_q_tiles=num_q_tiles, group=num_heads // num_kv_heads,
                               splits=splits, has_sinks=sinks_in_kernel)
    axes = compat.varying_axes(flat)  # Inside a jax.shard_map.
    # Outputs carry a leading axis of splits; the shares of one q tile are neighbours
    # on the last grid axis.
    out, lse = pl.pallas_call(
        kernel,
        grid=(num_q_tiles, num_heads, batch * splits),
        in_specs=tiles.whole_array_specs(flat),
        out_specs=[
            pl.BlockSpec((None, None, spec.tile_q, None, dim_v),
                         lambda i, h, bs: (lax.rem(bs, splits), lax.div(bs, splits), last - i,
                                           h, 0)),
            pl.BlockSpec((None, None, None, spec.tile_q),
                         lambda i, h, bs: (lax.rem(bs, splits), lax.div(bs, splits), h,
                                           last - i)),
        ],
        out_shape=[compat.result_type((splits, batch, q_len, num_heads, head_dim_v),
                                      q.dtype if splits == 1 else jnp.float32, axes),
                   compat.result_type((splits, batch, num_heads, q_len), jnp.float32, axes)],
        compiler_params=compat.triton_compiler_params(num_warps=config.num_warps,
                                                      num_stages=config.num_stages),
        interpret=interpret,
        name="omni_attention_fwd",
    )(*flat)
    out, lse = kv_splits.combine(out, lse, q.dtype)
    if sinks is None or sinks_in_kernel:
        return out, lse
    return fold_sinks(out, lse, sinks)

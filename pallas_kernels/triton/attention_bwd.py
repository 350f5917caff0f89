"""Block-sparse flash-attention backward pass, Pallas with Triton lowering (sm80+).

Two kernels, no atomics:

* dK/dV: one program per (kv tile, kv head, batch). For each query head of
  its GQA group it walks the active q tiles of its kv block (the kv-major
  view of the BlockMask) and accumulates dK and dV in float32 registers, so
  the reduction over the group's query heads happens in the kernel.
* dQ: one program per (q tile, query head, batch), walking the active kv
  tiles of its q block (the q-major view, as the forward does).

Both recompute ``p = exp(s - lse)`` from the forward's lse and use
``delta = rowsum(dO * O) - dlse`` (computed beforehand in JAX; the lse
cotangent folds into it). FULL tiles skip mask math as in the forward.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from typing import Any

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels import compat
from pallas_kernels.block_sparse import KernelMask, MaskLayout
from pallas_kernels.score_pipeline import ConvertedScoreMod
from pallas_kernels.softmax import softmax_delta
from pallas_kernels.triton import tiles

Array = Any


@dataclasses.dataclass(frozen=True)
class BackwardConfig:
    """Tile sizes and launch parameters of the dK/dV and dQ kernels.

    Tile sizes are upper bounds, as in `ForwardConfig`. Each kernel keeps a
    large tile of what it accumulates (kv rows for dK/dV, q rows for dQ) and
    walks small tiles of the other side.
    """

    block_q_dkv: int = 32
    block_kv_dkv: int = 64
    block_q_dq: int = 64
    block_kv_dq: int = 32
    num_warps: int = 4
    num_stages: int = 1
    # dK and dV in launches of their own: each program then holds one float32
    # accumulator instead of two (at head dim 256 the two spill), for one more QK^T per
    # tile (the dV launch's; it skips dO V^T).
    split_dkdv: bool = False


def _tile_probabilities(scores: tiles.TileScores, step: tiles.Step, q: Array, k: Array,
                        lse2: Array) -> tuple[Array, Array | None]:
    """(p, the score_mod's slope or None) of one tile, recomputed from the lse."""
    spec = scores.spec
    s, slope = scores.softmax_scores(tiles.dot_nt(q, k))
    return tiles.exp2(scores.masked(s, step), lse2, scale=spec.exp2_scale, ptx=spec.ptx), slope


def _tile_gradients(scores: tiles.TileScores, step: tiles.Step, q: Array, k: Array, v: Array,
                    do: Array, lse2: Array, delta: Array) -> tuple[Array, Array]:
    """(p, dS) of one tile; dS is d loss / d(q.k), the scale folded in."""
    spec = scores.spec
    p, slope = _tile_probabilities(scores, step, q, k, lse2)
    dp = tiles.dot_nt(do, v)
    ds = p * (dp - delta[:, None])
    if slope is not None:
        ds = ds * slope
    return p, ds * spec.scale


def _dkdv_kernel(*refs: Any, treedef: Any, spec: tiles.ScoreSpec, group: int,
                 gradients: tuple[str, ...]) -> None:
    """Sums ``gradients`` ("dk", "dv" or both) of one kv tile over its q walk."""
    inputs, out_refs = tiles.unpack_refs(refs, treedef)
    layout = spec.layout
    load = functools.partial(tiles.load_operand, inputs, layout)
    tq, tkv = spec.tile_q, spec.tile_kv
    kv_tile, kv_head, b = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    kv_start = kv_tile * tkv
    k = load("k", b, kv_start, tkv, kv_head)
    v = load("v", b, kv_start, tkv, kv_head) if "dk" in gradients else None
    mask = inputs["mask"]

    def head(g, carry):
        h = kv_head * group + g
        walk = tiles.Walk(mask.q_walk, b, h, lax.div(kv_start, layout.block_kv),
                          layout.block_q // tq)

        def body(step, sums):
            q_start = step.block * layout.block_q + step.sub * tq
            q = load("q", b, q_start, tq, h)
            do = load("do", b, q_start, tq, h)
            lse2 = inputs["lse2"][b, h, pl.ds(q_start, tq)]
            scores = tiles.TileScores(spec, mask, inputs["captured"], b, h, q_start, kv_start)
            sums = dict(sums)
            if "dk" in sums:
                delta = inputs["delta"][b, h, pl.ds(q_start, tq)]
                p, ds = _tile_gradients(scores, step, q, k, v, do, lse2, delta)
                sums["dk"] = sums["dk"] + tiles.dot_tn(ds.astype(q.dtype), q)
            else:
                p, _ = _tile_probabilities(scores, step, q, k, lse2)
            if "dv" in sums:
                sums["dv"] = sums["dv"] + tiles.dot_tn(p.astype(do.dtype), do)
            return sums

        return walk.fold(body, carry, spec.masked_tiles)

    refs = dict(zip(gradients, out_refs, strict=True))
    sums = lax.fori_loop(0, group, head, {name: jnp.zeros(ref.shape, jnp.float32)
                                          for name, ref in refs.items()})
    widths = {"dk": inputs["k"].shape[3], "dv": inputs["v"].shape[3]}
    for name, ref in refs.items():
        tiles.store_rows(ref, sums[name].astype(ref.dtype), kv_start,
                         length=inputs["k"].shape[1], dim=widths[name])


def _dq_kernel(*refs: Any, treedef: Any, spec: tiles.ScoreSpec, group: int) -> None:
    inputs, (dq_ref,) = tiles.unpack_refs(refs, treedef)
    layout = spec.layout
    load = functools.partial(tiles.load_operand, inputs, layout)
    tq, tkv = spec.tile_q, spec.tile_kv
    q_tile, h, b = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    kv_head = lax.div(h, group)
    q_start = q_tile * tq
    q = load("q", b, q_start, tq, h)
    do = load("do", b, q_start, tq, h)
    lse2 = inputs["lse2"][b, h, pl.ds(q_start, tq)]
    delta = inputs["delta"][b, h, pl.ds(q_start, tq)]
    mask = inputs["mask"]
    walk = tiles.Walk(mask.kv_walk, b, h, lax.div(q_start, layout.block_q),
                      layout.block_kv // tkv)

    def body(step, dq):
        kv_start = step.block * layout.block_kv + step.sub * tkv
        k = load("k", b, kv_start, tkv, kv_head)
        v = load("v", b, kv_start, tkv, kv_head)
        scores = tiles.TileScores(spec, mask, inputs["captured"], b, h, q_start, kv_start)
        _, ds = _tile_gradients(scores, step, q, k, v, do, lse2, delta)
        return dq + tiles.dot_nn(ds.astype(k.dtype), k)

    dq = walk.fold(body, jnp.zeros(q.shape, jnp.float32), spec.masked_tiles)
    tiles.store_rows(dq_ref, dq.astype(dq_ref.dtype), q_start, length=inputs["q"].shape[1],
                     dim=inputs["q"].shape[3])


def attention_backward(q: Array, k: Array, v: Array, mask: KernelMask, layout: MaskLayout,
                       captured: Sequence[Array], out: Array, lse: Array, dout: Array,
                       dlse: Array, *, scale: float, softcap: float | None,
                       score_mod: ConvertedScoreMod | None, config: BackwardConfig,
                       interpret: bool,
                       partial_tiles: bool = True) -> tuple[Array, Array, Array, Array]:
    """(dq, dk, dv, delta) of block-sparse attention; shapes as in `attention_forward`.

    ``delta [B, Hq, Sq]`` float32 is ``rowsum(dO * O) - dlse``, returned for the
    sink gradient. dK/dV of a kv head sum over its query heads. ``partial_tiles``
    as in `attention_forward`.
    """
    batch, q_len, num_heads, head_dim = q.shape
    kv_len, num_kv_heads, head_dim_v = k.shape[1], k.shape[2], v.shape[3]
    group = num_heads // num_kv_heads

    def score_spec(block_q: int, block_kv: int) -> tiles.ScoreSpec:
        return tiles.ScoreSpec(layout, tiles.tile_size(block_q, layout.block_q),
                               tiles.tile_size(block_kv, layout.block_kv), scale, softcap,
                               score_mod, tuple(jnp.shape(c) for c in captured), partial_tiles,
                               ptx=tiles.inline_ptx(interpret))

    dkdv_spec = score_spec(config.block_q_dkv, config.block_kv_dkv)
    dq_spec = score_spec(config.block_q_dq, config.block_kv_dq)
    dim, dim_v = tiles.padded_head_dim(head_dim), tiles.padded_head_dim(head_dim_v)

    delta = softmax_delta(out, dout, dlse)
    # p = exp2(s - lse2). A row that sees nothing (lse = -inf) and padding rows
    # get lse2 = +inf, so their p is exactly 0 instead of NaN.
    lse2 = jnp.where(lse == -jnp.inf, jnp.inf, lse.astype(jnp.float32) * tiles.LOG2E)
    operands = {
        "q": q,
        "k": k,
        "v": v,
        "do": dout.astype(q.dtype),
        "lse2": tiles.pad_to(lse2, 2, layout.padded_q_len, jnp.inf),
        "delta": tiles.pad_to(delta, 2, layout.padded_q_len),
        "mask": tiles.mask_operands(mask, layout, q_walk=True, kv_walk=True,
                                    partial_tiles=partial_tiles),
        "captured": [jnp.atleast_1d(c) for c in captured],
    }
    flat, treedef = tiles.pack_operands(operands)
    params = compat.triton_compiler_params(num_warps=config.num_warps,
                                           num_stages=config.num_stages)
    # Programs for the tiles that hold a row; the last ones' output blocks overhang the
    # arrays (rows past the length, columns past the head dim are not written).
    tkv = dkdv_spec.tile_kv
    axes = compat.varying_axes(flat)  # Inside a jax.shard_map.
    results = {"dk": (k, dim), "dv": (v, dim_v)}

    def dkdv_launch(gradients: tuple[str, ...]) -> list[Array]:
        return pl.pallas_call(
            functools.partial(_dkdv_kernel, treedef=treedef, spec=dkdv_spec, group=group,
                              gradients=gradients),
            grid=(pl.cdiv(kv_len, tkv), num_kv_heads, batch),
            in_specs=tiles.whole_array_specs(flat),
            out_specs=[pl.BlockSpec((None, tkv, None, results[name][1]),
                                    lambda i, h, b: (b, i, h, 0)) for name in gradients],
            out_shape=[compat.result_type(results[name][0].shape, results[name][0].dtype, axes)
                       for name in gradients],
            compiler_params=params, interpret=interpret,
            name="omni_attention_" + "".join(gradients),
        )(*flat)

    if config.split_dkdv:
        (dk,), (dv,) = dkdv_launch(("dk",)), dkdv_launch(("dv",))
    else:
        dk, dv = dkdv_launch(("dk", "dv"))
    tq = dq_spec.tile_q
    dq = pl.pallas_call(
        functools.partial(_dq_kernel, treedef=treedef, spec=dq_spec, group=group),
        grid=(pl.cdiv(q_len, tq), num_heads, batch),
        in_specs=tiles.whole_array_specs(flat),
        out_specs=pl.BlockSpec((None, tq, None, dim), lambda i, h, b: (b, i, h, 0)),
        out_shape=compat.result_type(q.shape, q.dtype, axes),
        compiler_params=params, interpret=interpret, name="omni_attention_dq",
    )(*flat)
    return dq, dk, dv, delta

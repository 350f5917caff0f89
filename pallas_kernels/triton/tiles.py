"""What the Triton attention kernels share: the mask walk and the score tile.

Scores live in the log2 domain inside the kernels (``s2 = score * log2(e)``,
so softmax uses ``exp2``); without softcap and score_mod the factor folds into
the scale. Kernel tiles may be smaller than the mask blocks they walk: a
mask block of ``block_q x block_kv`` is cut into ``block_q / tile_q`` by
``block_kv / tile_kv`` tiles that all share the block's flags, so a FULL block
stays free of mask math at any tile size.

Inputs are passed as whole-array refs and indexed with program ids, so one
kernel can read any head of any array (GQA, per-head masks) without
re-laying out the arrays in HBM. Sequence tails and head dims that are not a
power of two are read with masked loads (`load_rows`) and written through
output blocks that overhang the arrays, so no padded copies are made.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import struct
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pl_triton

from pallas_kernels import compat, kv_splits, runtime
from pallas_kernels.block_sparse import (
    KernelMask,
    MaskLayout,
    batch_head_index,
    packed_walk,
    tile_visibility,
    walk_offsets,
)
from pallas_kernels.captured import score_mod_on_refs
from pallas_kernels.score_pipeline import ConvertedScoreMod, transform_scores
from pallas_kernels.tile_classes import FULL, PARTIAL, trace_time_eval

Array = Any
LOG2E = math.log2(math.e)
LN2 = math.log(2.0)
MIN_TILE = 16  # Triton's tl.dot needs every dimension >= 16.
MAX_HEAD_DIM = 256


def padded_head_dim(head_dim: int) -> int:
    """The power-of-two head dim (>= 16) a kernel computes with; zeros fill the rest."""
    return max(MIN_TILE, pl.next_power_of_2(head_dim))


def tile_size(preferred: int, mask_block: int) -> int:
    """The largest power of two <= ``preferred`` that divides ``mask_block``."""
    tile = mask_block & -mask_block  # Largest power-of-two divisor.
    while tile > preferred:
        tile //= 2
    return tile


def load_rows(ref: Any, b: Array, start: Array, size: int, head: Array, *,
              padded_seq: int) -> Array:
    """Rows ``[start, start + size)`` of one head of a ``[B, S, H, D]`` ref, as
    ``(size, padded_head_dim(D))``.

    Rows past S and columns past D read as zeros, as if the array were padded to
    ``padded_seq`` rows (whole mask blocks: a walk may reach tiles past S) and to
    the power-of-two head dim the kernels compute with. Each mask is applied only
    where the array needs that padding.
    """
    seq, dim = ref.shape[1], ref.shape[3]
    width = padded_head_dim(dim)
    if seq == padded_seq and dim == width:
        return ref[b, pl.ds(start, size), head, :]
    masks = []
    if seq != padded_seq:
        masks.append(start + lax.broadcasted_iota(jnp.int32, (size, width), 0) < seq)
    if dim != width:
        masks.append(lax.broadcasted_iota(jnp.int32, (size, width), 1) < dim)
    columns = pl.ds(0 if dim == width else compat.triton_overhanging_start(), width)
    return compat.triton_load(ref.at[b, pl.ds(start, size), head, columns],
                              mask=functools.reduce(jnp.logical_and, masks), other=0.0)


def load_operand(inputs: Any, layout: MaskLayout, name: str, b: Array, start: Array,
                 size: int, head: Array) -> Array:
    """A tile of operand ``name`` ("q", "k", "v" or "do"), via `load_rows` with the
    sequence padded to whole mask blocks of its side (kv for k and v, q otherwise)."""
    padded_seq = layout.padded_kv_len if name in ("k", "v") else layout.padded_q_len
    return load_rows(inputs[name], b, start, size, head, padded_seq=padded_seq)


def store_rows(block_ref: Any, value: Array, start: Array, *, length: int,
               dim: int | None = None) -> None:
    """Writes ``value`` (rows ``[start, start + size)``, last axis ``width``) to an
    output block that may overhang its array: rows past ``length`` and columns past
    ``dim`` are masked, since the Triton lowering writes a block's every element."""
    size, width = value.shape[0], value.shape[-1]
    masks = []
    if length % size:
        masks.append(start + lax.broadcasted_iota(jnp.int32, value.shape, 0) < length)
    if dim is not None and dim != width:
        masks.append(lax.broadcasted_iota(jnp.int32, value.shape, value.ndim - 1) < dim)
    if not masks:
        block_ref[...] = value
        return
    compat.triton_store(block_ref, value, mask=functools.reduce(jnp.logical_and, masks))


def pad_to(x: Array, axis: int, size: int, value: float = 0.0) -> Array:
    """``x`` zero-padded (or ``value``-padded) along ``axis`` to ``size`` (no copy if equal)."""
    if x.shape[axis] == size:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, size - x.shape[axis])
    return jnp.pad(x, widths, constant_values=value)


@dataclasses.dataclass(frozen=True, eq=False)
class ScoreSpec:
    """Static description of how a kernel turns ``q @ k^T`` into masked log2 scores."""

    layout: MaskLayout
    tile_q: int
    tile_kv: int
    scale: float
    softcap: float | None
    score_mod: ConvertedScoreMod | None
    # Shapes of the score_mod's captured arrays (kernels receive them at least 1-D).
    captured_shapes: tuple[tuple[int, ...], ...] = ()
    # False when the mask is known to hold no PARTIAL tiles (masks built from
    # structured arguments only): the kernels then compile no stored-tile path.
    partial_tiles: bool = True
    # Compiled for an NVIDIA GPU (not interpreted): `exp2` may inline PTX.
    ptx: bool = False

    @property
    def computed_tiles(self) -> bool:
        """Whether any tile can be COMPUTED (a structured mask_mod or a ragged kv end)."""
        return self.layout.mask_mod_treedef is not None or self.layout.ragged_kv

    @property
    def masked_tiles(self) -> bool:
        """Whether any tile can be other than FULL (COMPUTED or PARTIAL)."""
        return self.computed_tiles or self.partial_tiles

    @property
    def plain(self) -> bool:
        """No softcap and no score_mod: the score is linear in ``q @ k^T``."""
        return self.softcap is None and self.score_mod is None

    @property
    def folds_scale(self) -> bool:
        """Raw ``q @ k^T`` goes to the softmax, which applies the scale inside `exp2`'s
        FMA (one instruction per score); a negative scale would turn masked -inf to +inf."""
        return self.plain and self.scale > 0

    @property
    def exp2_scale(self) -> float:
        """The factor `exp2` applies to the scores it is given (see `folds_scale`)."""
        return self.scale * LOG2E if self.folds_scale else 1.0


def _ptx_f32(value: float) -> str:
    """A float32 immediate in PTX's hexadecimal notation."""
    bits = struct.unpack("<I", struct.pack("<f", value))[0]
    return f"0f{bits:08X}"


def inline_ptx(interpret: bool) -> bool:
    """Whether a kernel launched with ``interpret`` compiles for an NVIDIA GPU."""
    return not interpret and runtime.gpu_compute_capability() is not None


def exp2(x: Array, shift: Array, *, scale: float, ptx: bool) -> Array:
    """``exp2(x * scale - shift)``, ``shift`` per row of ``x`` (its shape without the
    last axis) or per element.

    With ``ptx``, one FMA and one ``ex2.approx.ftz`` per element: ``jnp.exp2`` lowers
    through libdevice's exp2 without flush-to-zero, which guards every element against
    a denormal result with a compare and two predicated multiplies, and the scale and
    the shift would stay two instructions. Results below 2^-126 flush to zero, which
    no softmax weight notices. -inf scores give 0, as ``jnp.exp2`` does.
    """
    if shift.ndim < x.ndim:
        shift = shift[..., None]
    if not ptx:
        return jnp.exp2((x * scale if scale != 1.0 else x) - shift)
    asm = ("{ .reg .f32 t; fma.rn.f32 t, $1, " + _ptx_f32(scale)
           + ", $2; ex2.approx.ftz.f32 $0, t; }")
    [result] = pl_triton.elementwise_inline_asm(
        asm, args=[x, jnp.broadcast_to(-shift, x.shape)], constraints="=f,f,f", pack=1,
        result_shape_dtypes=[jax.ShapeDtypeStruct(x.shape, jnp.float32)])
    return result


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class MaskOperands:
    """The mask as the Triton kernels read it (`mask_operands`)."""

    q_walk: Array | None  # kv-blocks' walks over q-blocks (dK/dV), packed
    kv_walk: Array | None  # q-blocks' walks over kv-blocks (forward, dQ), packed
    partial_masks: Array | None  # stored tiles; None when the mask has no PARTIAL tile
    leaves: tuple[Array, ...]  # mask_mod leaves (`block_sparse` docstring)


def mask_operands(mask: KernelMask, layout: MaskLayout, *, q_walk: bool, kv_walk: bool,
                  partial_tiles: bool) -> MaskOperands:
    """The walks a kernel takes, each packed into one array (`block_sparse.packed_walk`),
    and the stored tiles only when ``partial_tiles``; computed while tracing when the
    mask is concrete, so that a static mask reaches the kernels as constants."""
    with trace_time_eval(layout, mask):
        return MaskOperands(
            q_walk=packed_walk(mask, "q") if q_walk else None,
            kv_walk=packed_walk(mask, "kv") if kv_walk else None,
            partial_masks=mask.partial_masks if partial_tiles else None,
            leaves=mask.leaves)


@dataclasses.dataclass(frozen=True)
class Step:
    """One tile of a walk: its mask block, sub-tile within the block, and the block's flags.

    ``full`` (static) says the tile is FULL: its scores need no mask.
    """

    block: Array
    sub: Array
    flags: Array
    partial_id: Array
    full: bool


class Walk:
    """The active tiles of one mask block row (q-major) or column (kv-major).

    ``ref`` is one orientation's packed walk (`MaskOperands`); ``subs`` is the
    number of kernel tiles per walked mask block. Steps run block by block,
    sub-tile by sub-tile: the FULL tiles (listed first) in one flat loop without
    mask code, then the masked tiles in another, each of which Triton can
    software-pipeline. ``contiguous_full`` (`MaskLayout.contiguous_full`): the
    FULL blocks are consecutive, so the FULL loop counts up from the first one
    instead of reading each index and its K/V addresses do not wait on a load.
    The forward passes it (3-5% faster on the H100); the backward kernels do not
    (2-3% slower there).
    """

    def __init__(self, ref: Any, b: Array, h: Array, block: Array, subs: int, *,
                 contiguous_full: bool = False):
        self._ref = ref
        mb, mh = batch_head_index(ref, b, h)
        self._lead = (mb, mh, block)
        self._offsets = walk_offsets((ref.shape[-1] - 2) // 3)
        self.subs = subs
        self._contiguous_full = contiguous_full

    def _entry(self, i: Any) -> Array:
        return self._ref[(*self._lead, i)]

    def fold(self, body: Any, carry: Any, masked_tiles: bool, split: Array = 0,
             splits: int = 1) -> Any:
        """``body(step, carry) -> carry`` over every step, or over share ``split`` of
        ``splits`` even shares of them (`kv_splits.share`); ``masked_tiles`` False
        promises that every tile is FULL (the mask has no COMPUTED or PARTIAL tile)."""
        begin, length, num_full = kv_splits.share(self._entry(0) * self.subs,
                                                  self._entry(1) * self.subs, split, splits)
        first = self._entry(self._offsets[0]) if self._contiguous_full else None
        carry = lax.fori_loop(begin, begin + num_full,
                              lambda it, c: body(self._step(it, True, first), c), carry)
        if masked_tiles:
            carry = lax.fori_loop(begin + num_full, begin + length,
                                  lambda it, c: body(self._step(it, False), c), carry)
        return carry

    def _step(self, it: Array, full: bool, first: Array | None = None) -> Step:
        """Step ``it``; its block is ``first`` + its position when given (contiguous).
        FULL steps read no flags or partial ids: they have none to apply."""
        j, sub = (it, 0) if self.subs == 1 else (lax.div(it, self.subs), lax.rem(it, self.subs))
        index, flags, partial_id = self._offsets
        block = self._entry(index + j) if first is None else first + j
        if full:
            return Step(block, sub, jnp.int32(FULL), jnp.int32(-1), full)
        return Step(block, sub, self._entry(flags + j), self._entry(partial_id + j), full)


def positions(start: Array, size: int, axis: int) -> Array:
    """Global positions ``start + [0, size)`` shaped ``[size, 1]`` (axis 0) or ``[1, size]``."""
    shape = (size, 1) if axis == 0 else (1, size)
    return start + lax.broadcasted_iota(jnp.int32, shape, axis)


# HIGHEST: float32 operands multiply in IEEE float32 (DEFAULT would lower to TF32);
# 16-bit operands are unaffected.
def _dot(a: Array, b: Array, contract: tuple[int, int]) -> Array:
    return lax.dot_general(a, b, (((contract[0],), (contract[1],)), ((), ())),
                           precision=lax.Precision.HIGHEST, preferred_element_type=jnp.float32)


def dot_nt(a: Array, b: Array) -> Array:
    """``a @ b.T`` accumulated in float32."""
    return _dot(a, b, (1, 1))


def dot_tn(a: Array, b: Array) -> Array:
    """``a.T @ b`` accumulated in float32."""
    return _dot(a, b, (0, 0))


def dot_nn(a: Array, b: Array) -> Array:
    """``a @ b`` accumulated in float32."""
    return _dot(a, b, (1, 0))


class TileScores:
    """Scores of the tile at (``q_start``, ``kv_start``) for batch ``b``, query head ``h``."""

    def __init__(self, spec: ScoreSpec, mask_refs: Any, captured_refs: Sequence[Any],
                 b: Array, h: Array, q_start: Array, kv_start: Array):
        self.spec = spec
        self.mask_refs = mask_refs
        self.captured_refs = captured_refs
        self.b, self.h = b, h
        self.q_start, self.kv_start = q_start, kv_start
        self.q_idx = positions(q_start, spec.tile_q, 0)
        self.kv_idx = positions(kv_start, spec.tile_kv, 1)

    def transform(self, scaled: Array) -> Array:
        """Softcap and score_mod of already-scaled scores (natural-log domain)."""
        score_mod = self.spec.score_mod
        if score_mod is not None and score_mod.num_captured:
            score_mod = score_mod_on_refs(score_mod, self.captured_refs,
                                          self.spec.captured_shapes)
        return transform_scores(scaled, softcap=self.spec.softcap, score_mod=score_mod,
                                captured=(), b=self.b, h=self.h, q_idx=self.q_idx,
                                kv_idx=self.kv_idx)

    def softmax_scores(self, qk: Array) -> tuple[Array, Array | None]:
        """(scores before masking, in log2 units once `exp2` applies ``spec.exp2_scale``:
        ``qk`` itself when the scale folds into the exp2; d score / d(scale * qk) or None
        when 1)."""
        spec = self.spec
        if spec.folds_scale:
            return qk, None
        if spec.plain:
            return qk * (spec.scale * LOG2E), None
        scaled = qk * spec.scale
        scores, slope = jax.jvp(self.transform, (scaled,), (jnp.ones_like(scaled),))
        return scores * LOG2E, slope

    def masked(self, s: Array, step: Step) -> Array:
        """``s`` with invisible elements at -inf; FULL steps skip the mask math entirely."""
        layout = self.spec.layout

        def computed(s, partial_tile=None):
            visible = tile_visibility(layout, step.flags, self.q_idx, self.kv_idx,
                                      self._leaf_values(), partial_tile)
            return s if visible is None else jnp.where(visible, s, -jnp.inf)

        def partial(s):
            return computed(s, self._partial_tile(step))

        # Only the tile kinds this mask can hold get code: a causal mask compiles
        # to no branch at all. Two-way lax.cond on bool predicates only: Triton
        # lowers each to one scf.if (a lax.switch here failed to compile on the
        # GPU: its index clamp came out of the Triton lowering as an i32/i1
        # arith.maxsi).
        spec = self.spec
        if step.full:
            return s
        if not spec.partial_tiles:
            return computed(s)
        if not spec.computed_tiles:
            return partial(s)
        return lax.cond((step.flags & PARTIAL) != 0, partial, computed, s)

    def _leaf_values(self) -> list[Array]:
        """Each mask_mod leaf at this tile: q slice ``[tq, 1]``, kv slice ``[1, tkv]``, scalar."""
        spec = self.spec
        values = []
        for ref, kind in zip(self.mask_refs.leaves, spec.layout.leaf_kinds, strict=True):
            row = self.b if ref.shape[0] > 1 else 0
            if kind == "batch":
                values.append(ref[row])
            elif kind == "q":
                values.append(ref[row, pl.ds(self.q_start, spec.tile_q)][:, None])
            else:
                values.append(ref[row, pl.ds(self.kv_start, spec.tile_kv)][None, :])
        return values

    def _partial_tile(self, step: Step) -> Array:
        """The slice of the stored mask tile that this kernel tile covers."""
        spec, layout = self.spec, self.spec.layout
        q_offset = lax.rem(self.q_start, layout.block_q)
        kv_offset = lax.rem(self.kv_start, layout.block_kv)
        return self.mask_refs.partial_masks[jnp.maximum(step.partial_id, jnp.int32(0)),
                                            pl.ds(q_offset, spec.tile_q),
                                            pl.ds(kv_offset, spec.tile_kv)]


def pack_operands(operands: Any) -> tuple[list[Array], Any]:
    """Flattens a pytree of kernel inputs; the kernel rebuilds it from its refs."""
    flat, treedef = jax.tree.flatten(operands)
    return flat, treedef


def unpack_refs(refs: Sequence[Any], treedef: Any) -> tuple[Any, Sequence[Any]]:
    """(input refs as the operand pytree, output refs)."""
    n = treedef.num_leaves
    return jax.tree.unflatten(treedef, list(refs[:n])), refs[n:]


def whole_array_specs(flat: Sequence[Array]) -> list[Any]:
    """Every input visible whole to every program (kernels index with program ids)."""
    return [pl.no_block_spec for _ in flat]


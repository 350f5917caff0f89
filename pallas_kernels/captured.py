"""A score_mod's captured arrays read inside a kernel through refs.

A kernel receives the captured arrays (ALiBi slopes, per-head tables) as refs.
Loading a whole array and letting the score_mod index it would make
``slopes[h]`` a ``dynamic_slice`` of a loaded value, which the Triton lowering
lacks. `score_mod_on_refs` evaluates the score_mod's jaxpr instead, turning a
dynamic slice of a captured array into a load of just that slice; any other use
loads the whole array. Indexing by the per-score ``q_idx``/``kv_idx`` stays a
gather, which the backends decline.

The Mosaic-GPU kernels read single elements only: `PackedCaptured` packs the
arrays into one float32 buffer that a kernel copies to shared memory, and
`score_mod_on_packed` reads each element a score_mod indexes by batch and head
as a scalar (`scalar_reads_reason` says when a score_mod needs more).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.extend import core as jex_core

from pallas_kernels import compat
from pallas_kernels.score_pipeline import ConvertedScoreMod


class _CapturedRef:
    """A captured array as a kernel ref, with its shape before the kernel's ``atleast_1d``."""

    def __init__(self, ref: Any, shape: tuple[int, ...]):
        self.ref, self.shape = ref, shape

    def load(self):
        return self.ref[...].reshape(self.shape)

    def load_slice(self, starts: Sequence[Any], sizes: Sequence[int]):
        # dynamic_slice clamps its starts into range; so do we.
        index = tuple(pl.ds(jnp.clip(start, 0, dim - size), size)
                      for start, dim, size in zip(starts, self.shape, sizes, strict=True))
        return self.ref[index]


class _ScalarRef(_CapturedRef):
    """A captured array inside a packed float32 smem buffer ``[rows, cols]``, read by
    element: a 0-d array whole, any other through slices of ones, read as one scalar
    (which `_evaluate` then passes through the squeeze that follows)."""

    def __init__(self, ref: Any, shape: tuple[int, ...], dtype: Any, offset: int, cols: int):
        super().__init__(ref, shape)
        self.dtype, self.offset, self.cols = dtype, offset, cols

    def _read(self, flat: Any):
        return self.ref[lax.div(flat, self.cols), lax.rem(flat, self.cols)].astype(self.dtype)

    def load(self):
        if self.shape:
            raise NotImplementedError("a packed captured array is read by element only")
        return self._read(jnp.int32(self.offset))

    def load_slice(self, starts: Sequence[Any], sizes: Sequence[int]):
        if any(size != 1 for size in sizes):
            raise NotImplementedError("a packed captured array is read by element only")
        index = jnp.int32(0)
        for start, dim in zip(starts, self.shape, strict=True):
            index = index * dim + jnp.clip(start, 0, dim - 1)
        return self._read(self.offset + index)


def _evaluate(jaxpr: Any, captured: Sequence[_CapturedRef], *args: Any,
              known: dict | None = None, invariant_only: bool = False) -> Any:
    """Evaluates ``jaxpr`` on (score, b, h, q_idx, kv_idx); b and h are a tile's scalars.

    A dynamic slice of a captured array at starts that depend on b and h only
    becomes a load of that slice; starts that vary per score (q_idx, kv_idx) need
    the whole array, and the slice becomes a gather. ``invariant_only`` evaluates
    just the equations that do not depend on the score or its position and returns
    their values, which a later call takes as ``known`` (they are not evaluated again).
    """
    env: dict[Any, Any] = dict(known or {})
    varying = {jaxpr.invars[i] for i in (0, 3, 4)}  # score, q_idx, kv_idx
    scalar_reads: set[Any] = set()  # Slices of ones read as scalars from a _ScalarRef.

    def read(var):
        return var.val if isinstance(var, jex_core.Literal) else env[var]

    def varies(vars_):
        return any(not isinstance(var, jex_core.Literal) and var in varying for var in vars_)

    env.update(zip(jaxpr.constvars, captured, strict=True))
    env.update(zip(jaxpr.invars, args, strict=True))
    for eqn in jaxpr.eqns:
        if known and all(var in known for var in eqn.outvars):
            continue
        if varies(eqn.invars):
            varying.update(eqn.outvars)
            if invariant_only:
                continue
        values = [read(var) for var in eqn.invars]
        if (eqn.primitive is lax.dynamic_slice_p and isinstance(values[0], _CapturedRef)
                and not varies(eqn.invars[1:])):
            outs = [values[0].load_slice(values[1:], eqn.params["slice_sizes"])]
            if isinstance(values[0], _ScalarRef):
                scalar_reads.add(eqn.outvars[0])
        elif eqn.primitive is lax.squeeze_p and eqn.invars[0] in scalar_reads:
            outs = values
        else:
            outs = compat.bind_equation(
                eqn, [v.load() if isinstance(v, _CapturedRef) else v for v in values])
        env.update(zip(eqn.outvars, outs, strict=True))
    if invariant_only:
        return env
    return [read(var) for var in jaxpr.outvars]


def score_mod_on_refs(score_mod: ConvertedScoreMod, refs: Sequence[Any],
                      shapes: Sequence[tuple[int, ...]]) -> ConvertedScoreMod:
    """``score_mod`` with its captured arrays read from ``refs`` (of arrays of ``shapes``).

    The result captures nothing: call it with ``captured=()``.
    """
    captured = [_CapturedRef(ref, tuple(shape)) for ref, shape in zip(refs, shapes, strict=True)]

    def fn(score, b, h, q_idx, kv_idx):
        return _evaluate(score_mod.jaxpr, captured, score, b, h, q_idx, kv_idx)[0]

    return ConvertedScoreMod(fn, 0)


# Captured arrays the Mosaic kernels take: float32 elements (of floats of at most 32 bits),
# read through a packed smem buffer of at most this many.
MAX_PACKED_ELEMENTS = 1024
_PACKED_COLS = 256  # TMA boxes hold at most 256 elements per dimension.


@dataclasses.dataclass(frozen=True)
class PackedCaptured:
    """Where each captured array lies in the packed float32 buffer ``[rows, cols]``."""

    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[Any, ...]
    offsets: tuple[int, ...]
    rows: int
    cols: int

    @staticmethod
    def layout_of(captured: Sequence[Any]) -> PackedCaptured:
        """The layout of arrays (or avals) ``captured``, without packing them."""
        sizes = [math.prod(c.shape) for c in captured]
        offsets = tuple(int(o) for o in np.cumsum([0, *sizes[:-1]]))
        total = max(1, sum(sizes))
        # Rows of 128-byte multiples (a warpgroup's TMA copies), at most _PACKED_COLS wide.
        cols = min(_PACKED_COLS, -(-total // 32) * 32)
        return PackedCaptured(tuple(tuple(c.shape) for c in captured),
                              tuple(jnp.dtype(c.dtype) for c in captured), offsets,
                              -(-total // cols), cols)

    @staticmethod
    def pack(captured: Sequence[Any]) -> tuple[PackedCaptured, Any]:
        """The layout and the packed ``[rows, cols]`` float32 buffer of ``captured``."""
        layout = PackedCaptured.layout_of(captured)
        flat = [jnp.ravel(c).astype(jnp.float32) for c in captured]
        padding = layout.rows * layout.cols - sum(f.shape[0] for f in flat)
        buffer = jnp.concatenate([*flat, jnp.zeros((padding,), jnp.float32)])
        return layout, buffer.reshape(layout.rows, layout.cols)


def scalar_reads_reason(score_mod: ConvertedScoreMod) -> str | None:
    """Why `score_mod_on_packed` cannot serve ``score_mod``'s captured arrays, or None.

    It serves float arrays of at most 32 bits, `MAX_PACKED_ELEMENTS` in all, each
    used only as a scalar (0-d) or through single elements at indices that depend on
    the batch and head alone (``slopes[h]``, ``table[b, h]``), not on the query or
    key position (a gather per score).
    """
    jaxpr = score_mod.jaxpr
    captured = [var.aval for var in jaxpr.constvars]
    for c in captured:
        dtype = jnp.dtype(c.dtype)
        if not jnp.issubdtype(dtype, jnp.floating) or dtype.itemsize > 4:
            return (f"score_mod captures a {dtype.name} array (the Mosaic kernels take "
                    f"floats of at most 32 bits)")
    total = sum(math.prod(c.shape) for c in captured)
    if total > MAX_PACKED_ELEMENTS:
        return (f"score_mod captures {total} elements (the Mosaic kernels take at most "
                f"{MAX_PACKED_ELEMENTS})")
    captured_vars = set(jaxpr.constvars)
    varying = {jaxpr.invars[i] for i in (0, 3, 4)}  # score, q_idx, kv_idx
    scalar_reads: set[Any] = set()
    for eqn in jaxpr.eqns:
        inputs = [v for v in eqn.invars if not isinstance(v, jex_core.Literal)]
        if any(v in varying for v in inputs):
            varying.update(eqn.outvars)
        if eqn.primitive is lax.dynamic_slice_p and eqn.invars[0] in captured_vars:
            if any(v in varying for v in inputs[1:]):
                return ("score_mod indexes a captured array by query or key position (a "
                        "gather per score; the Mosaic kernels read elements by batch and "
                        "head only)")
            if any(size != 1 for size in eqn.params["slice_sizes"]):
                return "score_mod slices a captured array (the Mosaic kernels read elements)"
            scalar_reads.add(eqn.outvars[0])
        elif eqn.primitive is lax.squeeze_p and inputs and inputs[0] in scalar_reads:
            continue
        elif any(v in scalar_reads for v in inputs) or any(
                v in captured_vars and v.aval.shape for v in inputs):
            where = eqn.primitive.name
            if list(jex_core.jaxprs_in_params(eqn.params)):
                where = f"a nested {where} call, as jnp functions such as jnp.take make,"
            return (f"score_mod uses a captured array in {where} (the Mosaic kernels read "
                    f"single elements: x[h], x[b, h], or 0-d arrays)")
    return None


def score_mod_on_packed(score_mod: ConvertedScoreMod, ref: Any, layout: PackedCaptured,
                        b: Any, h: Any) -> ConvertedScoreMod:
    """``score_mod`` for batch ``b`` and head ``h``, its captured arrays read as scalars
    from the packed ``ref``.

    What depends on ``b`` and ``h`` alone (the element reads among it) is evaluated
    here, once, not per score tile: a kernel calls this ahead of its kv loop. The
    result captures nothing and must be called with the same ``b`` and ``h`` and
    ``captured=()``.
    """
    captured = [_ScalarRef(ref, shape, dtype, offset, layout.cols) for shape, dtype, offset
                in zip(layout.shapes, layout.dtypes, layout.offsets, strict=True)]
    known = _evaluate(score_mod.jaxpr, captured, None, b, h, None, None, invariant_only=True)

    def fn(score, b, h, q_idx, kv_idx):
        return _evaluate(score_mod.jaxpr, captured, score, b, h, q_idx, kv_idx,
                         known=known)[0]

    return ConvertedScoreMod(fn, 0)


__all__ = ["MAX_PACKED_ELEMENTS", "PackedCaptured", "scalar_reads_reason",
           "score_mod_on_packed", "score_mod_on_refs"]

"""Structured mask predicates: causal, sliding window, documents, prefix-LM, chunks.

A `MaskMod` is a FlexAttention-style ``mask_mod(b, h, q_idx, kv_idx) -> bool``
that also knows its own structure, which buys two things:

* `classify` labels every (q-block, kv-block) tile FULL / MASKED / mixed in
  O(number of blocks), with interval arithmetic instead of evaluating elements;
* kernels evaluate it inside a tile from indices alone (`predicate`), so mixed
  tiles of structured masks need no stored bit-mask.

A MaskMod is a pytree: the arrays it closes over (segment ids, prefix lengths)
are its leaves, so masks are traced, jitted and vmapped like any other input.
Every leaf has a *kind* saying how it is indexed:

* ``"q"``: ``[batch, q_len]`` (one value per query position),
* ``"kv"``: ``[batch, kv_len]`` (one value per key position),
* ``"batch"``: ``[batch]`` (one value per sequence).

A batch size of 1 broadcasts. `gather_leaves` replaces each leaf by its value
at given (batch, position) indices; `predicate` then evaluates the mask from
gathered leaves and global indices. Kernels do the gathering themselves (they
load the q-block and kv-block slices of each leaf) and call `predicate`.
"""

from __future__ import annotations

import abc
import dataclasses
import functools
import operator
from collections.abc import Callable, Sequence
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.tile_classes import LeafKind

Array = Any
# A mask whose query rows each see one interval of keys [start(q), end(q)], both ends
# nondecreasing in q, promises "interval" ("prefix" when every start is key 0). Its FULL
# tiles then form one run of consecutive blocks in every q-block row and every kv-block
# column, which kernels walk without reading block indices (`BlockMask.contiguous_full`).
# None: no promise (documents: segment ids need not be sorted).
RowIntervals = Literal["prefix", "interval"] | None
# Masks compute with int32 indices; a window or chunk this wide covers every position,
# so larger sizes are clamped to it (the predicates then cannot overflow).
INT32_MAX = int(np.iinfo(np.int32).max)


@dataclasses.dataclass(frozen=True)
class BlockGrid:
    """The (q-block, kv-block) tiling of a ``q_len x kv_len`` score matrix.

    Bounds are inclusive and clipped to the real lengths, shaped to broadcast
    as ``[1, 1, num_q_blocks, 1]`` (q) and ``[1, 1, 1, num_kv_blocks]`` (kv).
    """

    q_len: int
    kv_len: int
    block_q: int
    block_kv: int

    @property
    def num_q_blocks(self) -> int:
        return -(-self.q_len // self.block_q)

    @property
    def num_kv_blocks(self) -> int:
        return -(-self.kv_len // self.block_kv)

    def q_bounds(self) -> tuple[np.ndarray, np.ndarray]:
        start = np.arange(self.num_q_blocks) * self.block_q
        end = np.minimum(start + self.block_q, self.q_len) - 1
        return start[None, None, :, None], end[None, None, :, None]

    def kv_bounds(self) -> tuple[np.ndarray, np.ndarray]:
        start = np.arange(self.num_kv_blocks) * self.block_kv
        end = np.minimum(start + self.block_kv, self.kv_len) - 1
        return start[None, None, None, :], end[None, None, None, :]


class MaskMod(abc.ABC):
    """A structured ``mask_mod(b, h, q_idx, kv_idx) -> bool`` (True = may attend)."""

    def __call__(self, b: Array, h: Array, q_idx: Array, kv_idx: Array) -> Array:
        del h  # No structured mask depends on the head.
        return self.gather_leaves(b, q_idx, kv_idx).predicate(q_idx, kv_idx)

    @abc.abstractmethod
    def predicate(self, q_idx: Array, kv_idx: Array) -> Array:
        """The mask at global indices, with every leaf already gathered there."""

    @abc.abstractmethod
    def classify(self, grid: BlockGrid) -> tuple[Array, Array]:
        """(full, empty) booleans per tile, broadcastable to ``[batch, 1, nq, nkv]``."""

    def leaf_kinds(self) -> tuple[LeafKind, ...]:
        """The kind of each leaf, in `jax.tree.leaves` order (none for index-only masks)."""
        return ()

    def row_intervals(self) -> RowIntervals:
        """What the mask promises about each query row's visible keys (`RowIntervals`)."""
        return None

    def gather_leaves(self, b: Array, q_idx: Array, kv_idx: Array) -> MaskMod:
        """A copy whose leaves are their values at (b, q_idx) / (b, kv_idx) / b.

        Indices broadcast against each other (scalars or index grids).
        """
        leaves, treedef = jax.tree.flatten(self)
        index = {"q": q_idx, "kv": kv_idx}
        gathered = []
        for leaf, kind in zip(leaves, self.leaf_kinds(), strict=True):
            batch = 0 if leaf.shape[0] == 1 else b
            if kind == "batch":
                gathered.append(leaf[batch])
            else:
                position = jnp.clip(index[kind], 0, leaf.shape[1] - 1)
                gathered.append(leaf[batch, position])
        return jax.tree.unflatten(treedef, gathered)

    def check_lengths(self, grid: BlockGrid) -> None:
        """Raises unless every q-/kv-indexed leaf has the grid's q_len / kv_len."""
        expected = {"q": grid.q_len, "kv": grid.kv_len}
        for leaf, kind in zip(jax.tree.leaves(self), self.leaf_kinds(), strict=True):
            if kind in expected and leaf.shape[-1] != expected[kind]:
                raise ValueError(f"mask_mod {type(self).__name__}: a {kind}-indexed array has "
                                 f"length {leaf.shape[-1]}, expected {kind}_len="
                                 f"{expected[kind]}")

    def batch_size(self) -> int:
        """Leading size of the leaves (1 when the mask is the same for every sequence)."""
        sizes = {leaf.shape[0] for leaf in jax.tree.leaves(self)} - {1}
        return sizes.pop() if sizes else 1


def has_contiguous_full_tiles(mask_mod: MaskMod | None) -> bool:
    """Whether the FULL tiles of ``mask_mod`` (None: dense attention) form one run of
    consecutive blocks in every q-block row and kv-block column, at any tiling."""
    return mask_mod is None or mask_mod.row_intervals() is not None


def includes_causal(mask_mod: MaskMod | None) -> bool:
    """Whether ``mask_mod`` is causal or an intersection with a causal mask (kernels pick
    their tiling by it)."""
    mods = [] if mask_mod is None else [mask_mod]
    while mods:
        mod = mods.pop()
        if isinstance(mod, Causal):
            return True
        if isinstance(mod, And):
            mods += list(mod.mods)
        if isinstance(mod, RepeatedQueries):
            mods.append(mod.inner)
    return False


def _static_pytree(cls):
    """Registers a MaskMod whose dataclass fields are all static (no leaves)."""

    def flatten(mod):
        return (), tuple(getattr(mod, f.name) for f in dataclasses.fields(mod))

    def unflatten(aux, _):
        return cls(*aux)

    jax.tree_util.register_pytree_node(cls, flatten, unflatten)
    return cls


@_static_pytree
@dataclasses.dataclass(frozen=True)
class Causal(MaskMod):
    """Query i sees keys j <= i + offset (offset 0: top-left aligned causal)."""

    offset: int = 0

    def __post_init__(self):
        object.__setattr__(self, "offset", max(-INT32_MAX, min(self.offset, INT32_MAX)))

    def predicate(self, q_idx, kv_idx):
        return kv_idx - q_idx <= self.offset  # a difference of int32 indices cannot overflow

    def classify(self, grid):
        q_start, q_end = grid.q_bounds()
        kv_start, kv_end = grid.kv_bounds()
        full = kv_end <= q_start + self.offset
        empty = kv_start > q_end + self.offset
        return jnp.asarray(full), jnp.asarray(empty)

    def row_intervals(self):
        return "prefix"


@_static_pytree
@dataclasses.dataclass(frozen=True)
class SlidingWindow(MaskMod):
    """Query i sees keys j in [i - left, i + right]; None leaves a side unbounded."""

    left: int | None
    right: int | None

    def __post_init__(self):
        for side in ("left", "right"):
            if getattr(self, side) is not None:
                object.__setattr__(self, side, min(getattr(self, side), INT32_MAX))

    def predicate(self, q_idx, kv_idx):
        # Differences of two int32 indices, unlike i + right, never overflow.
        visible = jnp.ones(jnp.broadcast_shapes(jnp.shape(q_idx), jnp.shape(kv_idx)), bool)
        if self.left is not None:
            visible &= q_idx - kv_idx <= self.left
        if self.right is not None:
            visible &= kv_idx - q_idx <= self.right
        return visible

    def classify(self, grid):
        q_start, q_end = grid.q_bounds()
        kv_start, kv_end = grid.kv_bounds()
        # jnp, not numpy: bounds are traced for masks at traced positions (`AtPositions`).
        full = jnp.ones((1, 1, grid.num_q_blocks, grid.num_kv_blocks), bool)
        empty = jnp.zeros_like(full)
        if self.left is not None:
            full &= kv_start >= q_end - self.left
            empty |= kv_end < q_start - self.left
        if self.right is not None:
            full &= kv_end <= q_start + self.right
            empty |= kv_start > q_end + self.right
        return jnp.asarray(full), jnp.asarray(empty)

    def row_intervals(self):
        return "prefix" if self.left is None else "interval"


@_static_pytree
@dataclasses.dataclass(frozen=True)
class Chunked(MaskMod):
    """Query i sees keys j in the same chunk: i // chunk_size == j // chunk_size."""

    chunk_size: int

    def __post_init__(self):
        object.__setattr__(self, "chunk_size", min(self.chunk_size, INT32_MAX))

    def predicate(self, q_idx, kv_idx):
        return q_idx // self.chunk_size == kv_idx // self.chunk_size

    def classify(self, grid):
        q_start, q_end = grid.q_bounds()
        kv_start, kv_end = grid.kv_bounds()
        c = self.chunk_size
        full = (q_start // c == q_end // c) & (kv_start // c == kv_end // c) & (
            q_start // c == kv_start // c
        )
        empty = (kv_end // c < q_start // c) | (kv_start // c > q_end // c)
        return jnp.asarray(full), jnp.asarray(empty)

    def row_intervals(self):
        return "interval"


def _block_min_max(ids: Array, length: int, block: int) -> tuple[Array, Array]:
    """Per-block min and max of ``ids [batch, length]`` -> ``[batch, num_blocks]``."""
    num_blocks = -(-length // block)
    padded = jnp.pad(ids, ((0, 0), (0, num_blocks * block - length)), mode="edge")
    blocks = padded.reshape(ids.shape[0], num_blocks, block)
    return blocks.min(axis=-1), blocks.max(axis=-1)


@jax.tree_util.register_pytree_node_class
class Document(MaskMod):
    """Packed documents: a query sees only keys with the same segment id."""

    def __init__(self, q_segment_ids: Array, kv_segment_ids: Array):
        self.q_segment_ids = q_segment_ids
        self.kv_segment_ids = kv_segment_ids

    def tree_flatten(self):
        return (self.q_segment_ids, self.kv_segment_ids), None

    @classmethod
    def tree_unflatten(cls, aux, children):
        return cls(*children)

    def predicate(self, q_idx, kv_idx):
        return self.q_segment_ids == self.kv_segment_ids

    def classify(self, grid):
        q_min, q_max = _block_min_max(self.q_segment_ids, grid.q_len, grid.block_q)
        kv_min, kv_max = _block_min_max(self.kv_segment_ids, grid.kv_len, grid.block_kv)
        q_min, q_max = q_min[:, None, :, None], q_max[:, None, :, None]
        kv_min, kv_max = kv_min[:, None, None, :], kv_max[:, None, None, :]
        full = (q_min == q_max) & (kv_min == kv_max) & (q_min == kv_min)
        empty = (q_max < kv_min) | (kv_max < q_min)
        return full, empty

    def leaf_kinds(self):
        return ("q", "kv")


@jax.tree_util.register_pytree_node_class
class KeyPrefix(MaskMod):
    """Query i sees keys j < lengths[b] (the bidirectional prefix of prefix-LM)."""

    def __init__(self, lengths: Array):
        self.lengths = lengths

    def tree_flatten(self):
        return (self.lengths,), None

    @classmethod
    def tree_unflatten(cls, aux, children):
        return cls(*children)

    def predicate(self, q_idx, kv_idx):
        return kv_idx < self.lengths

    def classify(self, grid):
        kv_start, kv_end = grid.kv_bounds()
        lengths = self.lengths[:, None, None, None]
        return kv_end < lengths, kv_start >= lengths

    def leaf_kinds(self):
        return ("batch",)

    def row_intervals(self):
        return "prefix"


class _Combination(MaskMod):
    """Common part of And / Or: children are MaskMods, leaves are theirs."""

    def __init__(self, *mods: MaskMod):
        self.mods = tuple(mods)

    def tree_flatten(self):
        return self.mods, None

    @classmethod
    def tree_unflatten(cls, aux, children):
        return cls(*children)

    # How children's visibility combines (``_join``) and its dual, which combines
    # the children's "empty tile" flags: And is (and, or), Or is (or, and).
    _join: Callable[[Any, Any], Any]
    _dual: Callable[[Any, Any], Any]

    def predicate(self, q_idx, kv_idx):
        return functools.reduce(self._join, (m.predicate(q_idx, kv_idx) for m in self.mods))

    def classify(self, grid):
        fulls, empties = zip(*(mod.classify(grid) for mod in self.mods), strict=True)
        return functools.reduce(self._join, fulls), functools.reduce(self._dual, empties)

    def leaf_kinds(self):
        return tuple(kind for mod in self.mods for kind in mod.leaf_kinds())

    def __repr__(self):
        return f"{type(self).__name__}({', '.join(map(repr, self.mods))})"


@jax.tree_util.register_pytree_node_class
class And(_Combination):
    """Visible where every child is visible."""

    _join = staticmethod(operator.and_)
    _dual = staticmethod(operator.or_)

    def row_intervals(self):
        # Intervals intersect to an interval: the largest start, the smallest end.
        kinds = {mod.row_intervals() for mod in self.mods}
        return None if None in kinds else "prefix" if kinds == {"prefix"} else "interval"


@jax.tree_util.register_pytree_node_class
class Or(_Combination):
    """Visible where any child is visible."""

    _join = staticmethod(operator.or_)
    _dual = staticmethod(operator.and_)

    def row_intervals(self):
        # Only prefixes unite to a prefix (to the largest end); other intervals may not meet.
        kinds = {mod.row_intervals() for mod in self.mods}
        return "prefix" if kinds == {"prefix"} else None


@dataclasses.dataclass(frozen=True)
class _QueryRowGrid(BlockGrid):
    """A `BlockGrid` over ``group`` rows per query position (row r is position
    r // group) whose q bounds are positions, for classifying the inner mask."""

    group: int = 1

    def q_bounds(self):
        start, end = super().q_bounds()
        return start // self.group, end // self.group


@jax.tree_util.register_pytree_node_class
class RepeatedQueries(MaskMod):
    """``inner`` with ``group`` query rows per position: row r sees what position
    r // group sees. The layout of grouped-query attention with the heads of a group
    packed into rows (`omni_jax.query_groups`). Build with `RepeatedQueries.of`."""

    def __init__(self, inner: MaskMod, group: int):
        self.inner = inner
        self.group = group

    @classmethod
    def of(cls, mask_mod: MaskMod, group: int) -> RepeatedQueries:
        """``mask_mod`` with its query-indexed arrays repeated ``group`` times along q."""
        leaves, treedef = jax.tree.flatten(mask_mod)
        leaves = [jnp.repeat(leaf, group, axis=1) if kind == "q" else leaf
                  for leaf, kind in zip(leaves, mask_mod.leaf_kinds(), strict=True)]
        return cls(jax.tree.unflatten(treedef, leaves), group)

    def tree_flatten(self):
        return (self.inner,), self.group

    @classmethod
    def tree_unflatten(cls, aux, children):
        return cls(*children, aux)

    def predicate(self, q_idx, kv_idx):
        return self.inner.predicate(q_idx // self.group, kv_idx)

    def classify(self, grid):
        # Index-based masks read the grid's q bounds (positions); leaf-based ones the
        # repeated leaves, which are as long as the grid's rows.
        return self.inner.classify(_QueryRowGrid(grid.q_len, grid.kv_len, grid.block_q,
                                                   grid.block_kv, self.group))

    def leaf_kinds(self):
        return self.inner.leaf_kinds()

    def row_intervals(self):
        # Rows of one position see its interval; positions stay in order.
        return self.inner.row_intervals()

    def __repr__(self):
        return f"RepeatedQueries({self.inner!r}, group={self.group})"


@dataclasses.dataclass(frozen=True)
class _PositionGrid(BlockGrid):
    """A `BlockGrid` whose block bounds are the smallest and largest of given positions
    in each block: index-based masks classify their tiles by these positions."""

    q_positions: Any = None
    kv_positions: Any = None

    def q_bounds(self):
        low, high = _block_min_max(self.q_positions, self.q_len, self.block_q)
        return low[:, None, :, None], high[:, None, :, None]

    def kv_bounds(self):
        low, high = _block_min_max(self.kv_positions, self.kv_len, self.block_kv)
        return low[:, None, None, :], high[:, None, None, :]


@jax.tree_util.register_pytree_node_class
class AtPositions(MaskMod):
    """``inner`` evaluated at the given positions: query row i is at position
    ``q_positions[b, i]``, key j at ``kv_positions[b, j]`` (int ``[batch or 1, len]``).

    A shard of a longer sequence (context parallelism) keeps the global meaning of
    causal, window and chunk masks this way; leaf-based masks (documents) read their own
    per-row arrays as before. Tiles are classified from each block's smallest and
    largest position, which is exact for masks whose visible keys form an interval.
    """

    def __init__(self, inner: MaskMod, q_positions: Array, kv_positions: Array):
        self.inner = inner
        self.q_positions = q_positions
        self.kv_positions = kv_positions

    def tree_flatten(self):
        return (self.q_positions, self.kv_positions, self.inner), None

    @classmethod
    def tree_unflatten(cls, aux, children):
        q_positions, kv_positions, inner = children
        return cls(inner, q_positions, kv_positions)

    def predicate(self, q_idx, kv_idx):
        # The position leaves are gathered at (q_idx, kv_idx) already: they are the indices.
        return self.inner.predicate(self.q_positions, self.kv_positions)

    def classify(self, grid):
        return self.inner.classify(_PositionGrid(
            grid.q_len, grid.kv_len, grid.block_q, grid.block_kv,
            jnp.asarray(self.q_positions), jnp.asarray(self.kv_positions)))

    def leaf_kinds(self):
        return ("q", "kv", *self.inner.leaf_kinds())

    def __repr__(self):
        return f"AtPositions({self.inner!r})"


# Ready-made mask_mods. Each is a MaskMod, so create_block_mask classifies it
# analytically, and it also works as a plain FlexAttention mask_mod.

causal_mask = Causal()


def sliding_window_mask(left: int | None, right: int | None = 0) -> MaskMod:
    """Keys within ``[i - left, i + right]`` of query i (``right=0``: causal window)."""
    for name, value in (("left", left), ("right", right)):
        if value is not None and (not is_int(value) or value < 0):
            raise ValueError(f"sliding_window_mask: {name} must be a non-negative int or None, "
                             f"got {value!r}")
    return SlidingWindow(None if left is None else int(left), None if right is None else int(right))


def is_int(value: Any) -> bool:
    """A Python or numpy integer, not a bool (sizes and indices given as arguments)."""
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def _as_segment_ids(name: str, ids: Array) -> Array:
    ids = jnp.asarray(ids)
    if ids.ndim == 1:
        ids = ids[None]
    if ids.ndim != 2 or not jnp.issubdtype(ids.dtype, jnp.integer):
        raise ValueError(f"document_mask: {name} must be an integer array [batch, seq_len] or "
                         f"[seq_len], got shape {ids.shape} dtype {ids.dtype}")
    return ids


def segment_ids_as_int32(q_ids: Array, kv_ids: Array) -> tuple[Array, Array]:
    """Integer segment ids as the int32 ids that kernels compare, equal exactly where the
    given ones are equal.

    Ids of up to 32 bits are cast (uint32 wraps around, which keeps them distinct).
    64-bit ids (``jax_enable_x64``) are cast when they are concrete and fit int32;
    otherwise each becomes its rank among all the ids, which keeps their order too.
    """
    if max(q_ids.dtype.itemsize, kv_ids.dtype.itemsize) <= 4:
        return q_ids.astype(jnp.int32), kv_ids.astype(jnp.int32)
    bounds = np.iinfo(np.int32)
    if not any(isinstance(ids, jax.core.Tracer) for ids in (q_ids, kv_ids)) and all(
            ids.size == 0 or bounds.min <= int(ids.min()) and int(ids.max()) <= bounds.max
            for ids in (q_ids, kv_ids)):
        return q_ids.astype(jnp.int32), kv_ids.astype(jnp.int32)
    ordered = jnp.sort(jnp.concatenate([q_ids.ravel(), kv_ids.ravel()]))
    rank = lambda ids: jnp.searchsorted(ordered, ids).astype(jnp.int32)
    return rank(q_ids), rank(kv_ids)


def document_mask(q_segment_ids: Array, kv_segment_ids: Array | None = None) -> MaskMod:
    """Packed documents: query i sees key j where their segment ids are equal.

    Args:
      q_segment_ids: integer ``[batch, q_len]`` (or ``[q_len]``, batch 1) document ids.
      kv_segment_ids: integer ``[batch, kv_len]`` (or ``[kv_len]``); default
        ``q_segment_ids``. A batch of 1 broadcasts against the other's.
    """
    q_ids = _as_segment_ids("q_segment_ids", q_segment_ids)
    kv_ids = q_ids if kv_segment_ids is None else _as_segment_ids("kv_segment_ids",
                                                                  kv_segment_ids)
    if q_ids.shape[0] != kv_ids.shape[0] and 1 not in (q_ids.shape[0], kv_ids.shape[0]):
        raise ValueError(f"document_mask: q_segment_ids batch {q_ids.shape[0]} and "
                         f"kv_segment_ids batch {kv_ids.shape[0]} differ")
    return Document(*segment_ids_as_int32(q_ids, kv_ids))


def prefix_lm_mask(prefix_lengths: Array | int) -> MaskMod:
    """Prefix-LM: keys before ``prefix_lengths[b]`` are visible to all, the rest causally.

    ``prefix_lengths``: an int (every sequence) or an integer ``[batch]`` array.
    """
    lengths = jnp.asarray(prefix_lengths)
    if lengths.ndim == 0:
        lengths = lengths[None]
    if lengths.ndim != 1 or not jnp.issubdtype(lengths.dtype, jnp.integer):
        raise ValueError(f"prefix_lm_mask: prefix_lengths must be an int or an integer array "
                         f"[batch], got shape {lengths.shape} dtype {lengths.dtype}")
    if jnp.iinfo(lengths.dtype).max > INT32_MAX:  # a longer prefix covers every key too
        lengths = jnp.minimum(lengths, INT32_MAX)
    return Or(Causal(), KeyPrefix(lengths.astype(jnp.int32)))


def chunked_mask(chunk_size: int, causal: bool = True) -> MaskMod:
    """Chunked local attention (Llama 4): query i sees keys j with ``i // chunk_size ==
    j // chunk_size``, and only ``j <= i`` when ``causal`` (the default)."""
    if not is_int(chunk_size) or chunk_size <= 0:
        raise ValueError(f"chunked_mask: chunk_size must be a positive int, got {chunk_size!r}")
    if not isinstance(causal, (bool, np.bool_)):
        raise TypeError(f"chunked_mask: causal must be a bool, got {causal!r}")
    chunks = Chunked(int(chunk_size))
    return And(Causal(), chunks) if causal else chunks


MaskFn = Callable[[Array, Array, Array, Array], Array]


def and_masks(*mask_mods: MaskFn) -> MaskFn:
    """Intersection of mask_mods; structured if every argument is a MaskMod."""
    return _combine("and_masks", And, jnp.logical_and, mask_mods)


def or_masks(*mask_mods: MaskFn) -> MaskFn:
    """Union of mask_mods; structured if every argument is a MaskMod."""
    return _combine("or_masks", Or, jnp.logical_or, mask_mods)


def _combine(name: str, structured: type[_Combination], op,
             mask_mods: Sequence[MaskFn]) -> MaskFn:
    if not mask_mods:
        raise ValueError(f"{name}: at least one mask_mod is needed")
    for i, mod in enumerate(mask_mods):
        if not callable(mod):
            raise TypeError(f"{name}: mask_mods[{i}] must be callable, got "
                            f"{type(mod).__name__}")
    if all(isinstance(mod, MaskMod) for mod in mask_mods):
        return structured(*mask_mods)

    def combined(b, h, q_idx, kv_idx):
        result = mask_mods[0](b, h, q_idx, kv_idx)
        for mod in mask_mods[1:]:
            result = op(result, mod(b, h, q_idx, kv_idx))
        return result

    return combined

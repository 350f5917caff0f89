"""Block masks: every constructor agrees with its element-wise definition.

Property tests draw random lengths, block sizes and compositions of the
structured masks and check the BlockMask (both walks, tile classification,
partial bit-masks) against a NumPy evaluation of the definition.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import omni_jax
from omni_jax.masks import COMPUTED, FULL, MASKED, PARTIAL, BlockMask
from omni_jax.masks.mask_mods import Causal, RepeatedQueries

SETTINGS = settings(max_examples=15, deadline=None)


# -- NumPy definitions of the structured masks --------------------------------------------


def _segment_ids(draw, batch: int, length: int) -> np.ndarray:
    cuts = draw(st.lists(st.integers(1, max(1, length - 1)), max_size=4))
    ids = np.zeros((batch, length), np.int32)
    for b in range(batch):
        for cut in cuts[b::batch] if batch > 1 else cuts:
            ids[b, cut:] += 1
    return ids


@st.composite
def structured_masks(draw):
    """(mask_mod, numpy predicate(b, q [Q,1], kv [1,K]) -> bool, batch, q_len, kv_len)."""
    batch = draw(st.integers(1, 2))
    q_len = draw(st.integers(1, 150))
    kv_len = draw(st.sampled_from([q_len, draw(st.integers(1, 150))]))

    def leaf():
        kind = draw(st.sampled_from(["causal", "window", "chunked", "documents", "prefix"]))
        if kind == "causal":
            return omni_jax.causal_mask, lambda b, q, k: k <= q
        if kind == "window":
            # Sizes past int32 cover everything; the kernels' int32 indices must not overflow.
            sizes = st.none() | st.integers(0, 60) | st.sampled_from([2**31 - 1, 2**31, 2**40])
            left, right = draw(sizes), draw(sizes)
            return (omni_jax.sliding_window_mask(left, right),
                    lambda b, q, k: (left is None or k >= q - left)
                    & ((right is None) | (k <= q + (right or 0))))
        if kind == "chunked":
            size = draw(st.integers(1, 70) | st.sampled_from([2**31, 2**40]))
            return (omni_jax.chunked_mask(size, causal=False),
                    lambda b, q, k: q // size == k // size)
        if kind == "documents":
            if q_len != kv_len:
                q_ids, kv_ids = _segment_ids(draw, batch, q_len), _segment_ids(draw, batch, kv_len)
            else:
                q_ids = kv_ids = _segment_ids(draw, batch, q_len)
            return (omni_jax.document_mask(jnp.asarray(q_ids), jnp.asarray(kv_ids)),
                    lambda b, q, k: q_ids[b][q] == kv_ids[b][k])
        lengths = np.asarray(draw(st.lists(st.integers(0, kv_len), min_size=batch,
                                           max_size=batch)), np.int32)
        return (omni_jax.prefix_lm_mask(jnp.asarray(lengths)),
                lambda b, q, k: (k < lengths[b]) | (k <= q))

    mods = [leaf() for _ in range(draw(st.integers(1, 3)))]
    combine = draw(st.sampled_from(["and", "or"]))
    if combine == "and":
        mod = omni_jax.and_masks(*(m for m, _ in mods))
        predicate = lambda b, q, k: np.logical_and.reduce(
            [np.broadcast_to(p(b, q, k), (q.size, k.size)) for _, p in mods])
    else:
        mod = omni_jax.or_masks(*(m for m, _ in mods))
        predicate = lambda b, q, k: np.logical_or.reduce(
            [np.broadcast_to(p(b, q, k), (q.size, k.size)) for _, p in mods])
    return mod, predicate, batch, q_len, kv_len


def _expected_dense(predicate, batch, q_len, kv_len) -> np.ndarray:
    q = np.arange(q_len)[:, None]
    kv = np.arange(kv_len)[None, :]
    return np.stack([np.broadcast_to(predicate(b, q, kv), (q_len, kv_len))
                     for b in range(batch)])[:, None]


def _walk_to_dense(num_blocks, indices, flags, ids, num_cols):
    """Scatters one walk back to dense (flags, partial ids) ``[..., rows, num_cols]``."""
    num_blocks, indices, flags, ids = map(np.asarray, (num_blocks, indices, flags, ids))
    dense_flags = np.full((*num_blocks.shape, num_cols), MASKED)
    dense_ids = np.full((*num_blocks.shape, num_cols), -1)
    for pos in np.ndindex(num_blocks.shape):
        n = num_blocks[pos]
        cols = indices[pos][:n]
        assert len(set(cols.tolist())) == n, "a walk visits a tile twice"
        assert np.all(np.diff(cols) > 0), "a walk is not in increasing order"
        dense_flags[pos][cols] = flags[pos][:n]
        dense_ids[pos][cols] = ids[pos][:n]
    return dense_flags, dense_ids


def check_block_mask(mask: BlockMask, expected: np.ndarray) -> None:
    """The mask's element view, tile classes and both walks against ``expected``."""
    batch = expected.shape[0]
    dense = np.asarray(mask.to_dense())
    np.testing.assert_array_equal(np.broadcast_to(dense, expected.shape), expected)
    grid = mask.grid
    nq, nkv = grid.num_q_blocks, grid.num_kv_blocks
    kv_major = _walk_to_dense(mask.kv_num_blocks, mask.kv_indices, mask.kv_tile_flags,
                              mask.kv_partial_ids, nkv)
    q_major = _walk_to_dense(mask.q_num_blocks, mask.q_indices, mask.q_tile_flags,
                             mask.q_partial_ids, nq)
    np.testing.assert_array_equal(kv_major[0], q_major[0].swapaxes(-1, -2))
    np.testing.assert_array_equal(kv_major[1], q_major[1].swapaxes(-1, -2))

    bq, bkv = mask.block_size

    def per_tile(fill, reduce):
        padded = np.full((batch, 1, nq * bq, nkv * bkv), fill)
        padded[:, :, :grid.q_len, :grid.kv_len] = expected
        tiles = padded.reshape(batch, 1, nq, bq, nkv, bkv).swapaxes(3, 4)
        return reduce(tiles, axis=(-1, -2))

    flags = np.broadcast_to(kv_major[0], (batch, 1, nq, nkv))
    any_visible = per_tile(False, np.any)
    all_visible = per_tile(True, np.all)  # Rows/columns past the ends do not count.
    # A skipped tile hides nothing; a FULL tile shows everything.
    assert not np.any(any_visible & (flags == MASKED))
    assert np.all(all_visible[flags == FULL])
    partial = np.asarray(mask.partial_masks)
    ids = np.broadcast_to(kv_major[1], flags.shape)
    assert np.all(ids[(flags >= 0) & ((flags & PARTIAL) != 0)] >= 0)
    assert np.all(ids[(flags >= 0) & ((flags & PARTIAL) == 0)] == -1)
    assert len({partial[i].tobytes() for i in np.unique(ids[ids >= 0])}) == len(
        np.unique(ids[ids >= 0])), "identical partial tiles are stored twice"
    if mask.contiguous_full:
        # The kernels count through the FULL tiles of a row or column from the first one.
        for rows in (flags, flags.swapaxes(-1, -2)):
            for row in rows.reshape(-1, rows.shape[-1]):
                full = np.flatnonzero(row == FULL)
                assert np.all(np.diff(full) == 1), f"FULL tiles {full} are not consecutive"


block_sizes = st.sampled_from([(8, 8), (16, 16), (16, 32), (32, 8), (64, 64)])


@SETTINGS
@given(structured_masks(), block_sizes)
def test_structured_masks_match_their_definition(spec, block_size):
    mod, predicate, batch, q_len, kv_len = spec
    mask = omni_jax.create_block_mask(mod, batch, None, q_len, kv_len, block_size)
    assert mask.contiguous_full == (mod.row_intervals() is not None)
    check_block_mask(mask, _expected_dense(predicate, batch, q_len, kv_len))


@settings(max_examples=10, deadline=None)
@given(structured_masks(), block_sizes)
def test_generic_mask_mod_matches_structured(spec, block_size):
    """A plain function (evaluated element-wise, bit-masks deduplicated) gives the same mask."""
    mod, predicate, batch, q_len, kv_len = spec
    mask = omni_jax.create_block_mask(lambda b, h, q, k: mod(b, h, q, k), batch, None,
                                      q_len, kv_len, block_size)
    expected = _expected_dense(predicate, batch, q_len, kv_len)
    check_block_mask(mask, expected)
    computed = (np.asarray(mask.tile_flags()) & COMPUTED) != 0
    computed &= np.asarray(mask.tile_flags()) >= 0
    # Only the ragged last kv block bounds indices; a plain function has no other index math.
    assert not computed[..., :-1].any()
    assert not computed.any() or kv_len % block_size[1] != 0


def test_generic_mask_mod_per_head():
    """A head-dependent mask_mod: per-head walks."""
    def every_other_key_per_head(b, h, q, k):
        return (k + h) % 2 == 0

    mask = omni_jax.create_block_mask(every_other_key_per_head, None, 3, 40, 50, (16, 16))
    assert mask.shape == (1, 3, 40, 50)
    k = np.arange(50)
    expected = np.stack([np.broadcast_to((k + h) % 2 == 0, (40, 50)) for h in range(3)])
    np.testing.assert_array_equal(np.asarray(mask.to_dense())[0], expected)
    # One stored tile per (key parity, whole or ragged q block, whole or ragged kv block).
    assert mask.partial_masks.shape[0] <= 8


def test_mask_built_inside_jit_from_traced_document_ids():
    ids = np.repeat(np.arange(4), [10, 30, 5, 19])[None].astype(np.int32)

    @jax.jit
    def build(ids):
        return omni_jax.create_block_mask(
            lambda b, h, q, k: (ids[b, q] == ids[b, k]) & (k <= q), 1, None, 64, 64, (16, 16))

    mask = build(jnp.asarray(ids))
    expected = (ids[0][:, None] == ids[0][None, :]) & np.tri(64, dtype=bool)
    np.testing.assert_array_equal(np.asarray(mask.to_dense())[0, 0], expected)
    structured = jax.jit(lambda ids: omni_jax.create_block_mask(
        omni_jax.and_masks(omni_jax.causal_mask, omni_jax.document_mask(ids)),
        1, None, 64, 64, (16, 16)))(jnp.asarray(ids))
    np.testing.assert_array_equal(np.asarray(structured.to_dense())[0, 0], expected)


def test_restrict_intersects():
    mask = omni_jax.create_block_mask(omni_jax.chunked_mask(40, causal=False), None, None,
                                      100, 100, (16, 16))
    both = mask.restrict(omni_jax.causal_mask)
    expected = (np.arange(100)[:, None] // 40 == np.arange(100)[None] // 40) & np.tri(100,
                                                                                      dtype=bool)
    np.testing.assert_array_equal(np.asarray(both.to_dense())[0, 0], expected)
    assert both.sparsity() >= mask.sparsity()


def test_contiguous_full_tiles_are_promised_only_by_interval_masks():
    """Causal, windows, chunks and prefixes promise consecutive FULL tiles (also intersected
    with each other); documents, unions with them and evaluated functions do not."""
    ids = jnp.asarray(np.repeat([0, 1, 0], [32, 16, 16])[None], jnp.int32)  # Unsorted.
    build = lambda mod: omni_jax.create_block_mask(mod, None, None, 64, 64, (16, 16))
    chunks = build(omni_jax.chunked_mask(24, causal=False))
    assert chunks.contiguous_full
    assert chunks.restrict(omni_jax.sliding_window_mask(10, 0)).contiguous_full
    assert not chunks.restrict(omni_jax.document_mask(ids)).contiguous_full
    assert build(omni_jax.prefix_lm_mask(20)).contiguous_full
    assert not build(omni_jax.or_masks(omni_jax.causal_mask,
                                       omni_jax.chunked_mask(24, causal=False))).contiguous_full
    documents = build(omni_jax.document_mask(ids))
    assert not documents.contiguous_full
    full = np.flatnonzero(np.asarray(documents.tile_flags())[0, 0, 3] == FULL)
    assert full.tolist() == [0, 1, 3]  # Why documents make no promise.
    assert not build(lambda b, h, q, k: k <= q).contiguous_full
    leaves, treedef = jax.tree.flatten(chunks)
    assert jax.tree.unflatten(treedef, leaves).contiguous_full


def test_repr_sparsity_and_shape():
    mask = omni_jax.create_block_mask(omni_jax.causal_mask, None, None, 256, 256, (64, 64))
    assert mask.shape == (1, 1, 256, 256)
    assert mask.sparsity() == pytest.approx(6 / 16)
    text = repr(mask)
    assert "c..." in text and "#c.." in text and "sparsity=37.50%" in text


def test_repr_of_abstract_and_traced_masks():
    build = lambda: omni_jax.create_block_mask(omni_jax.causal_mask, None, None, 128, 128)
    assert repr(jax.eval_shape(build)).endswith("block_size=(128, 128), traced)")
    jax.jit(lambda: print(build()) or 0)()  # printing inside jit does not fail


def test_mask_is_a_pytree_that_vmaps():
    ids = jnp.asarray(np.random.default_rng().integers(0, 3, (4, 1, 48)).cumsum(-1), jnp.int32)
    masks = jax.vmap(lambda i: omni_jax.create_block_mask(
        omni_jax.document_mask(i), 1, None, 48, 48, (16, 16)))(ids)
    leaves, treedef = jax.tree.flatten(masks)
    assert all(leaf.shape[0] == 4 for leaf in leaves)
    for i in range(4):
        one = jax.tree.unflatten(treedef, [leaf[i] for leaf in leaves])
        expected = np.asarray(ids[i, 0])[:, None] == np.asarray(ids[i, 0])[None]
        np.testing.assert_array_equal(np.asarray(one.to_dense())[0, 0], expected)


@pytest.mark.parametrize(("args", "message"), [
    ((omni_jax.causal_mask, 1, 1, 0, 16), "q_len"),
    ((omni_jax.causal_mask, 1, 1, 16, 16, (0, 16)), "block_size"),
    ((omni_jax.causal_mask, 1, 1, 16, 16, 0), r"block_size .* got 0$"),
    ((omni_jax.causal_mask, 0, 1, 16, 16), "batch"),
    (("not callable", 1, 1, 16, 16), "mask_mod"),
    ((lambda b, h, i, j: i - j, 1, 1, 16, 16),
     r"must return one bool scalar .* got \['int32\[\]'\]"),
    ((lambda b, h, i, j: None, 1, 1, 16, 16), r"must return one bool scalar .* got \[\]"),
    ((lambda b, h, i, j: jnp.stack([i >= j, i < j]), 1, 1, 16, 16), r"got \['bool\[2\]'\]"),
    ((lambda q_idx, kv_idx: q_idx >= kv_idx, 1, 1, 16, 16),
     r"^create_block_mask: mask_mod failed when called as mask_mod\(b, h, q_idx, kv_idx\) on "
     r"int32 scalars: .*2 positional arguments but 4"),
    ((lambda b, h, i, j: i >= j if i > 0 else j == 0, 1, 1, 16, 16),  # a Python `if`
     r"^create_block_mask: mask_mod failed .* on int32 scalars: .*"),
])
def test_create_block_mask_rejects_bad_arguments(args, message):
    with pytest.raises((ValueError, TypeError), match=message):
        omni_jax.create_block_mask(*args)


def test_plain_mask_mods_with_index_arithmetic_under_x64():
    """The mask_mod is traced with int32 indices and evaluated with int32 ones, also when
    jax_enable_x64 makes int64 the default."""
    with jax.enable_x64(True):
        mask = omni_jax.create_block_mask(lambda b, h, q, k: (q + k) % 3 != 0, None, None,
                                          40, 40, (16, 16))
        q, k = np.arange(40)[:, None], np.arange(40)[None]
        np.testing.assert_array_equal(np.asarray(mask.to_dense())[0, 0], (q + k) % 3 != 0)


@pytest.mark.parametrize("offset", [2**31 - 5, 2**40, -(2**40)])
def test_causal_offset_beyond_int32(offset):
    mask = omni_jax.create_block_mask(Causal(offset), None, None, 40, 40, (16, 16))
    q, k = np.arange(40)[:, None], np.arange(40)[None]
    np.testing.assert_array_equal(np.asarray(mask.to_dense())[0, 0], k <= q + offset)


def test_restrict_rejects_what_it_cannot_classify():
    mask = omni_jax.create_block_mask(omni_jax.causal_mask, 2, None, 32, 32, (16, 16))
    with pytest.raises(TypeError, match="restrict takes a structured mask .* got function"):
        mask.restrict(lambda b, h, q, k: q >= k)
    with pytest.raises(ValueError, match="kv-indexed array has length 20, expected kv_len=32"):
        mask.restrict(omni_jax.document_mask(jnp.zeros((2, 32), jnp.int32),
                                             jnp.zeros((2, 20), jnp.int32)))
    with pytest.raises(ValueError, match="batch size 3, this mask 2"):
        mask.restrict(omni_jax.document_mask(jnp.zeros((3, 32), jnp.int32)))


def test_traced_mask_density_says_it_needs_a_concrete_mask():
    ids = jnp.zeros((1, 32), jnp.int32)
    density = lambda ids: omni_jax.create_block_mask(omni_jax.document_mask(ids), 1, None,
                                                     32, 32, (16, 16)).density()
    with pytest.raises(TypeError, match="must be concrete"):
        jax.jit(density)(ids)


@pytest.mark.parametrize(("build", "message"), [
    (lambda: omni_jax.sliding_window_mask(True), "left must be .* got True"),
    (lambda: omni_jax.sliding_window_mask(4, -1), "right must be .* got -1"),
    (lambda: omni_jax.chunked_mask(True), "chunk_size must be a positive int, got True"),
])
def test_mask_sizes_reject_non_ints(build, message):
    with pytest.raises(ValueError, match=message):
        build()


@pytest.mark.parametrize(("build", "error", "message"), [
    (lambda: omni_jax.chunked_mask(0), ValueError, r"^chunked_mask: chunk_size .* got 0$"),
    (lambda: omni_jax.chunked_mask(4, causal="no"), TypeError,
     r"^chunked_mask: causal must be a bool, got 'no'$"),
    (lambda: omni_jax.prefix_lm_mask(2.5), ValueError, r"^prefix_lm_mask: prefix_lengths"),
    (lambda: omni_jax.document_mask(jnp.zeros((2, 8))), ValueError,
     r"^document_mask: q_segment_ids must be an integer array"),
    (lambda: omni_jax.and_masks(), ValueError, r"^and_masks: at least one mask_mod"),
    (lambda: omni_jax.or_masks(omni_jax.causal_mask, 3), TypeError,
     r"^or_masks: mask_mods\[1\] must be callable, got int$"),
])
def test_mask_constructor_errors_name_the_constructor(build, error, message):
    with pytest.raises(error, match=message):
        build()


@pytest.mark.parametrize("dtype", ["int64", "uint64", "uint32"])
@pytest.mark.parametrize("traced", [False, True])
def test_document_ids_of_any_integer_type_stay_distinct(dtype, traced):
    """Ids that differ only above bit 31 (or in a uint32's top bit) are other documents."""
    with jax.enable_x64(True):
        rng = np.random.default_rng()
        step = 2**32 if np.dtype(dtype).itemsize == 8 else 2**31
        ids = np.sort(rng.integers(0, 3, (2, 40))).astype(dtype) * np.asarray(step, dtype)
        build = lambda ids: omni_jax.create_block_mask(omni_jax.document_mask(ids), 2, None,
                                                       40, 40, (16, 16)).to_dense()
        dense = (jax.jit(build) if traced else build)(jnp.asarray(ids))
        expected = ids[:, None, :, None] == ids[:, None, None, :]
        np.testing.assert_array_equal(np.asarray(dense), expected)


def test_document_mask_rejects_mismatched_ids():
    ids = jnp.zeros((2, 32), jnp.int32)
    with pytest.raises(ValueError, match="batch"):
        omni_jax.create_block_mask(omni_jax.document_mask(ids), 3, None, 32, 32, (16, 16))


@settings(max_examples=8, deadline=None)
@given(structured_masks(), block_sizes, st.sampled_from([2, 4, 8]), st.booleans())
def test_repeated_queries_match_the_mask_row_by_row(spec, block_size, group, generic):
    """A mask over ``group`` rows per query position (grouped-query heads packed into
    rows), built from a mask's tiles or classified from its mask_mod, is that mask with
    every row repeated: stored tiles (``generic``) and structured ones alike."""
    mod, predicate, batch, q_len, kv_len = spec
    expected = np.repeat(_expected_dense(predicate, batch, q_len, kv_len), group, axis=2)
    source = (lambda b, h, q, k: mod(b, h, q, k)) if generic else mod
    mask = omni_jax.create_block_mask(source, batch, None, q_len, kv_len, block_size)
    check_block_mask(mask.repeat_queries(group), expected)
    classified = omni_jax.create_block_mask(RepeatedQueries.of(mod, group), batch, None,
                                            q_len * group, kv_len, block_size)
    check_block_mask(classified, expected)


def test_repeat_queries_needs_a_group_dividing_the_q_tile():
    mask = omni_jax.create_block_mask(omni_jax.causal_mask, None, None, 40, 40, (16, 16))
    with pytest.raises(ValueError, match="group must divide block_q=16, got 3"):
        mask.repeat_queries(3)

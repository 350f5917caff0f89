"""`pallas_kernels.triton.tiles`: row tiles read and written without padded copies, and
the kernels' exp2.

Interpreted (`interpret=True`); the CUDA lowering of the same forms is covered by
`test_triton_attention.test_kernels_lower_to_triton` (ragged lengths, head dim 80), and
exp2's inline PTX by its compiled case (GPU only).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.experimental import pallas as pl

from pallas_kernels import compat
from pallas_kernels.triton import tiles

BATCH, HEADS = 2, 3

shapes = st.tuples(
    st.integers(1, 150),                        # sequence length
    st.sampled_from([16, 40, 64, 80, 96, 128]),  # head dim
    st.sampled_from([16, 32, 64]),              # tile rows
    st.sampled_from([1, 2]),                    # tiles per mask block
)


def _array(seed: int, seq: int, dim: int) -> jax.Array:
    rng = np.random.default_rng(seed)
    return jnp.asarray(rng.standard_normal((BATCH, seq, HEADS, dim)), jnp.float32)


@settings(max_examples=12, deadline=None)
@given(shape=shapes, seed=st.integers(0, 2**31 - 1))
def test_load_rows_reads_as_if_padded(shape, seed):
    """Every tile of whole mask blocks, those wholly past the end included, reads the
    array zero-padded to those blocks and to the power-of-two width."""
    seq, dim, tile, tiles_per_block = shape
    block = tile * tiles_per_block
    padded_seq = pl.cdiv(seq, block) * block
    width = tiles.padded_head_dim(dim)
    x = _array(seed, seq, dim)

    def kernel(x_ref, o_ref):
        i, h, b = pl.program_id(0), pl.program_id(1), pl.program_id(2)
        o_ref[...] = tiles.load_rows(x_ref, b, i * tile, tile, h, padded_seq=padded_seq)

    out = pl.pallas_call(
        kernel, grid=(padded_seq // tile, HEADS, BATCH),
        in_specs=[pl.no_block_spec],
        out_specs=pl.BlockSpec((None, tile, None, width), lambda i, h, b: (b, i, h, 0)),
        out_shape=jax.ShapeDtypeStruct((BATCH, padded_seq, HEADS, width), x.dtype),
        interpret=True,
    )(x)
    expected = jnp.pad(x, ((0, 0), (0, padded_seq - seq), (0, 0), (0, width - dim)))
    np.testing.assert_array_equal(np.asarray(out), np.asarray(expected))


@settings(max_examples=12, deadline=None)
@given(shape=shapes, seed=st.integers(0, 2**31 - 1))
def test_store_rows_writes_only_inside_the_array(shape, seed):
    """Tiles overhanging the sequence end and the head dim: the array gets exactly its
    own rows and columns of them. The tiles are views of the whole output here, so an
    unmasked overhang would show (the interpreter pads overhanging BlockSpec blocks)."""
    seq, dim, tile, _ = shape
    width = tiles.padded_head_dim(dim)
    num_tiles = pl.cdiv(seq, tile)
    padded = _array(seed, num_tiles * tile, width)

    def kernel(y_ref, o_ref, lse_ref):
        i, h, b = pl.program_id(0), pl.program_id(1), pl.program_id(2)
        rows = pl.ds(i * tile, tile)
        columns = pl.ds(compat.triton_overhanging_start(), width)
        tiles.store_rows(o_ref.at[b, rows, h, columns], y_ref[...], i * tile, length=seq,
                         dim=dim)
        tiles.store_rows(lse_ref.at[b, h, rows], y_ref[:, 0], i * tile, length=seq)

    out, lse = pl.pallas_call(
        kernel, grid=(num_tiles, HEADS, BATCH),
        in_specs=[pl.BlockSpec((None, tile, None, width), lambda i, h, b: (b, i, h, 0))],
        out_specs=[pl.no_block_spec, pl.no_block_spec],
        out_shape=[jax.ShapeDtypeStruct((BATCH, seq, HEADS, dim), padded.dtype),
                   jax.ShapeDtypeStruct((BATCH, HEADS, seq), padded.dtype)],
        interpret=True,
    )(padded)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(padded[:, :seq, :, :dim]))
    np.testing.assert_array_equal(np.asarray(lse),
                                  np.asarray(jnp.swapaxes(padded[:, :seq, :, 0], 1, 2)))


@pytest.mark.parametrize("ptx", [
    False, pytest.param(True, marks=[pytest.mark.gpu, pytest.mark.smoke])])
def test_exp2_scales_shifts_and_gives_zero_for_minus_inf(ptx):
    """`tiles.exp2` is ``exp2(x * scale - shift)`` per row: masked scores (-inf) and rows
    that see nothing (shift +inf) give exactly 0, never NaN; compiled (``ptx``), its
    approximate exp2 stays within float32 rounding of the float64 value."""
    if ptx and jax.default_backend() != "gpu":
        pytest.skip("inline PTX needs a CUDA GPU")
    rng = np.random.default_rng()
    x = rng.uniform(-40.0, 10.0, (32, 64)).astype(np.float32)
    x[3, 5:9] = -np.inf
    shift = rng.uniform(-5.0, 15.0, 32).astype(np.float32)
    shift[7] = np.inf
    scale = float(rng.uniform(0.05, 0.3))

    def kernel(x_ref, shift_ref, o_ref):
        o_ref[...] = tiles.exp2(x_ref[...], shift_ref[...], scale=scale, ptx=ptx)

    out = np.asarray(pl.pallas_call(
        kernel, out_shape=jax.ShapeDtypeStruct(x.shape, jnp.float32),
        interpret=not ptx)(jnp.asarray(x), jnp.asarray(shift)))
    expected = np.exp2(x.astype(np.float64) * np.float32(scale) - shift[:, None])
    assert not np.isnan(out).any()
    assert (out[3, 5:9] == 0).all() and (out[7] == 0).all()
    normal = expected > 2.0 ** -120  # below, ex2.approx.ftz may flush to zero
    np.testing.assert_allclose(out[normal], expected[normal], rtol=2e-6)

"""Helpers shared by the Mosaic attention kernels: which tile indices they build (only
those a mask or score_mod reads: jax 0.11's Mosaic layout inference rejects an index
broadcast nothing reads), and the head dims that serve a problem's."""

import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import omni_jax
from omni_jax.scores import convert_score_mod
from pallas_kernels.block_sparse import kernel_mask
from pallas_kernels.mosaic import attention_sm90_common as common

SEGMENTS = np.repeat(np.arange(2, dtype=np.int32), 128)[None]


@pytest.mark.parametrize("mask_mod,length,reads", [
    (omni_jax.causal_mask, 256, (True, True)),
    (omni_jax.sliding_window_mask(30, 0), 256, (True, True)),
    # Segment ids are leaves: the predicate reads no index, and a whole number of
    # kv-blocks needs no kv bound.
    (omni_jax.document_mask(SEGMENTS), 256, (False, False)),
    (omni_jax.document_mask(SEGMENTS[:, :200]), 200, (False, True)),
    (omni_jax.and_masks(omni_jax.causal_mask, omni_jax.document_mask(SEGMENTS)), 256,
     (True, True)),
], ids=["causal", "window", "documents", "documents_ragged", "causal_documents"])
def test_visibility_reads(mask_mod, length, reads):
    block_mask = omni_jax.create_block_mask(mask_mod, 1, None, length, length, (128, 128))
    _, layout = kernel_mask(block_mask)
    assert common.visibility_reads(layout) == reads


def _dead_q_read(s, b, h, i, j):
    del b, h
    _ = i * 2  # computed, never used: dead code is not a read
    return s - 0.1 * j


@pytest.mark.parametrize("score_mod,reads", [
    (lambda s, b, h, i, j: s * 0.5, (False, False)),
    (lambda s, b, h, i, j: s - 0.1 * i, (True, False)),
    (lambda s, b, h, i, j: s - jnp.abs(i - j), (True, True)),
    (_dead_q_read, (False, True)),
], ids=["none", "q", "both", "dead_q_read"])
def test_score_spec_reads_indices(score_mod, reads):
    converted, captured = convert_score_mod(score_mod)
    spec, _ = common.score_spec(0.1, None, converted, captured)
    assert spec.reads_indices == reads


@pytest.mark.parametrize("dims,padded", [
    ((128, 128), (128, 128)), ((80, 40), (96, 64)), ((192, 128), (192, 128)),
    ((64, 256), (64, 256)), ((160, 256), (256, 256)), ((256, 192), (256, 256)),
    ((200, 300), (256, None)),
])
def test_padded_head_dims(dims, padded):
    """192 beside 256 takes 256 for both (Q and O in one buffer: shared memory)."""
    assert common.padded_head_dims(*dims) == padded


@settings(max_examples=60, deadline=None)
@given(num_heads=st.integers(1, 70), num_blocks=st.integers(1, 40), section=st.integers(1, 9))
def test_sectioned_launch_visits_every_cta_once_longest_first(num_heads, num_blocks,
                                                              section):
    """Every (head, block rank) once; a section launches rank 0 (the longest walk) of
    each of its heads before any of their rank 1, and sections go in head order."""
    positions = jnp.arange(num_heads * num_blocks, dtype=jnp.int32)
    heads, ranks = (np.asarray(x) for x in common.sectioned_position(
        positions, num_heads, num_blocks, section))
    assert sorted(zip(heads.tolist(), ranks.tolist(), strict=True)) == [
        (h, r) for h in range(num_heads) for r in range(num_blocks)]
    order = np.lexsort((heads, ranks, heads // section))
    np.testing.assert_array_equal(order, np.arange(len(positions)))

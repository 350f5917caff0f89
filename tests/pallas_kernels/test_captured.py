"""Captured arrays read inside kernels give what the plain score_mod gives: through refs
(`score_mod_on_refs`, Triton) and by element from a packed buffer (`score_mod_on_packed`,
Mosaic), which `scalar_reads_reason` admits only for element reads by batch and head."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.experimental import pallas as pl

from omni_jax.scores import convert_score_mod, primitive_names
from pallas_kernels.captured import (
    MAX_PACKED_ELEMENTS,
    PackedCaptured,
    scalar_reads_reason,
    score_mod_on_packed,
    score_mod_on_refs,
)
from pallas_kernels.score_pipeline import apply_score_mod

_RNG = np.random.default_rng()  # fresh values every run
_SLOPES = jnp.asarray(_RNG.standard_normal(4), jnp.float32)
_BATCH_HEAD = jnp.asarray(_RNG.standard_normal((2, 4)), jnp.float32)
_TABLE = jnp.asarray(_RNG.standard_normal(32), jnp.float32)
_SCALE = jnp.asarray(1.5, jnp.float32)

SCORE_MODS = {
    "alibi": lambda s, b, h, q, k: s - _SLOPES[h] * (q - k),
    "batch_head_table": lambda s, b, h, q, k: s + _BATCH_HEAD[b, h],
    "negative_head_index": lambda s, b, h, q, k: s + _SLOPES[h - 4],
    "clamped_head_index": lambda s, b, h, q, k: s + _SLOPES[h + 10],  # clamped like jnp
    "scalar_capture": lambda s, b, h, q, k: s * _SCALE,
    "per_score_table": lambda s, b, h, q, k: s + _TABLE[jnp.clip(q - k, 0, 31)],
}


def _on_refs(score_mod, captured, scores, b, h, q_idx, kv_idx):
    """The kernels' path: captured arrays (at least 1-D, as kernels get them) as refs."""
    def body(refs):
        *captured_refs, out_ref = refs
        mod = score_mod_on_refs(score_mod, captured_refs, [c.shape for c in captured])
        out_ref[...] = apply_score_mod(mod, (), scores, b, h, q_idx, kv_idx)

    inputs = (*(jnp.atleast_1d(c) for c in captured), jnp.zeros_like(scores))
    return pl.run_state(body)(inputs)[-1]


@pytest.mark.parametrize("name", sorted(SCORE_MODS))
@pytest.mark.parametrize("b,h", [(0, 0), (1, 3)])
def test_refs_give_the_plain_score_mod(name, b, h):
    score_mod, captured = convert_score_mod(SCORE_MODS[name])
    scores = jnp.asarray(_RNG.standard_normal((16, 16)), jnp.float32)
    q_idx = jnp.arange(16, dtype=jnp.int32)[:, None] + 5
    kv_idx = jnp.arange(16, dtype=jnp.int32)[None, :]
    args = (scores, jnp.int32(b), jnp.int32(h), q_idx, kv_idx)
    expected = apply_score_mod(score_mod, captured, *args)
    np.testing.assert_array_equal(_on_refs(score_mod, captured, *args), expected)


@pytest.mark.parametrize("name,gathers", [("alibi", False), ("batch_head_table", False),
                                          ("per_score_table", True)])
def test_only_per_score_indexing_gathers(name, gathers):
    score_mod, captured = convert_score_mod(SCORE_MODS[name])
    scores = jax.ShapeDtypeStruct((16, 16), jnp.float32)
    q_idx = jnp.arange(16, dtype=jnp.int32)[:, None]
    kv_idx = jnp.arange(16, dtype=jnp.int32)[None, :]
    jaxpr = jax.make_jaxpr(lambda s: _on_refs(score_mod, captured, s, jnp.int32(0),
                                              jnp.int32(1), q_idx, kv_idx))(scores).jaxpr
    names = primitive_names(jaxpr)
    assert ("gather" in names) == gathers
    assert "dynamic_slice" not in names or gathers


_ELEMENT_READS = ("alibi", "batch_head_table", "negative_head_index", "clamped_head_index",
                  "scalar_capture")


@pytest.mark.parametrize("name", sorted(SCORE_MODS))
def test_scalar_reads_reason(name):
    score_mod, _ = convert_score_mod(SCORE_MODS[name])
    reason = scalar_reads_reason(score_mod)
    assert (reason is None) == (name in _ELEMENT_READS), reason


@pytest.mark.parametrize("name", _ELEMENT_READS)
@pytest.mark.parametrize("b,h", [(0, 0), (1, 3)])
def test_packed_elements_give_the_plain_score_mod(name, b, h):
    score_mod, captured = convert_score_mod(SCORE_MODS[name])
    layout, packed = PackedCaptured.pack(captured)
    assert packed.shape == (layout.rows, layout.cols) and layout.cols % 32 == 0
    scores = jnp.asarray(_RNG.standard_normal((16, 16)), jnp.float32)
    q_idx = jnp.arange(16, dtype=jnp.int32)[:, None] + 5
    kv_idx = jnp.arange(16, dtype=jnp.int32)[None, :]
    args = (scores, jnp.int32(b), jnp.int32(h), q_idx, kv_idx)
    expected = apply_score_mod(score_mod, captured, *args)

    def body(refs):
        packed_ref, out_ref = refs
        mod = score_mod_on_packed(score_mod, packed_ref, layout, *args[1:3])
        out_ref[...] = apply_score_mod(mod, (), *args)

    np.testing.assert_array_equal(pl.run_state(body)((packed, jnp.zeros_like(scores)))[-1],
                                  expected)


def test_packing_spans_rows_and_keeps_dtypes():
    """Arrays past one 256-wide row, bf16 among them, are read back exactly."""
    big = jnp.asarray(_RNG.standard_normal((3, 100)), jnp.bfloat16)
    small = jnp.asarray(_RNG.standard_normal(7), jnp.float32)
    score_mod, captured = convert_score_mod(
        lambda s, b, h, q, k: s + big[b, h].astype(jnp.float32) * small[h])
    assert scalar_reads_reason(score_mod) is None
    layout, packed = PackedCaptured.pack(captured)
    assert layout.rows == 2 and layout.cols == 256
    for b, h in [(0, 0), (2, 99), (1, 6)]:
        args = (jnp.ones((4, 4), jnp.float32), jnp.int32(b), jnp.int32(h),
                jnp.zeros((4, 1), jnp.int32), jnp.zeros((1, 4), jnp.int32))

        def body(refs, args=args):
            packed_ref, out_ref = refs
            mod = score_mod_on_packed(score_mod, packed_ref, layout, *args[1:3])
            out_ref[...] = apply_score_mod(mod, (), *args)

        got = pl.run_state(body)((packed, jnp.zeros((4, 4), jnp.float32)))[-1]
        np.testing.assert_array_equal(got, apply_score_mod(score_mod, captured, *args))


def test_too_many_captured_elements_are_declined():
    table = jnp.zeros((MAX_PACKED_ELEMENTS + 1,), jnp.float32)
    score_mod, _ = convert_score_mod(lambda s, b, h, q, k: s + table[h])
    assert "elements" in scalar_reads_reason(score_mod)


_CAPTURED_SHAPES = st.lists(
    st.tuples(st.lists(st.integers(1, 40), min_size=0, max_size=2),
              st.sampled_from(["float32", "bfloat16", "float16"])),
    min_size=1, max_size=3)


@settings(max_examples=25, deadline=None)
@given(_CAPTURED_SHAPES, st.integers(0, 50), st.integers(-3, 50))
def test_packed_reads_match_indexing_for_any_shapes(specs, b, h):
    """Arrays of any rank up to 2, shape and float dtype, indexed by batch and head (with
    jnp's clamping of out-of-range and negative indices): the packed reads match."""
    rng = np.random.default_rng()
    arrays = [jnp.asarray(rng.standard_normal(shape), dtype) for shape, dtype in specs]
    total = sum(math.prod(shape) for shape, _ in specs)

    def read(array, b, h):
        if array.ndim == 0:
            return array
        return array[h] if array.ndim == 1 else array[b, h]

    score_mod, captured = convert_score_mod(
        lambda s, b, h, q, k: s + sum(read(a, b, h).astype(jnp.float32) for a in arrays))
    if total > MAX_PACKED_ELEMENTS:
        assert "elements" in scalar_reads_reason(score_mod)
        return
    assert scalar_reads_reason(score_mod) is None
    layout, packed = PackedCaptured.pack(captured)
    args = (jnp.zeros((2, 2), jnp.float32), jnp.int32(b), jnp.int32(h),
            jnp.zeros((2, 1), jnp.int32), jnp.zeros((1, 2), jnp.int32))

    def body(refs):
        packed_ref, out_ref = refs
        mod = score_mod_on_packed(score_mod, packed_ref, layout, *args[1:3])
        out_ref[...] = apply_score_mod(mod, (), *args)

    got = pl.run_state(body)((packed, jnp.zeros((2, 2), jnp.float32)))[-1]
    np.testing.assert_array_equal(got, apply_score_mod(score_mod, captured, *args))


def test_a_captured_array_passed_to_a_nested_call_is_reported_so():
    """jnp.take traces to a nested jit call: the reason says so rather than naming the
    call's primitive alone (which reads as if the user had jitted something)."""
    score_mod, _ = convert_score_mod(lambda s, b, h, q, k: s + jnp.take(_TABLE, h))
    assert "nested" in scalar_reads_reason(score_mod)

"""Re-tiling a concrete BlockMask to a kernel's block size admits exactly the same
elements, skips every tile it can and stores no tile twice; the planner re-tiles masks
of block sizes a backend declines, and leaves masks of its own size untouched."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import omni_jax
from omni_jax.masks import FULL, MASKED
from omni_jax.masks.regroup import regroup, regroupable
from pallas_kernels import runtime
from tests.forced_configs import record_plans
from tests.mosaic_interpret import interpreted_mosaic
from tests.omni_jax.attention_suite import Case, check_case
from tests.omni_jax.masks.test_block_mask import check_block_mask, structured_masks

SIZES = st.sampled_from([8, 16, 24, 32, 48, 64, 128])


@st.composite
def block_mask_pairs(draw):
    """(mask, its element view, target block size): structured masks, stored-tile masks
    and the two restricted together."""
    mask_mod, predicate, batch, q_len, kv_len = draw(structured_masks())
    source = (draw(SIZES), draw(SIZES))
    target = (draw(SIZES), draw(SIZES))
    kind = draw(st.sampled_from(["structured", "stored", "stored_and_structured"]))
    if kind == "structured":
        mask = omni_jax.create_block_mask(mask_mod, batch, None, q_len, kv_len, source)
    else:
        seed = draw(st.integers(0, 2**31 - 1))
        bits = jnp.asarray(np.random.default_rng(seed).random((batch, q_len, kv_len)) < 0.6)
        mask = omni_jax.create_block_mask(lambda b, h, q, k: bits[b, q, k], batch, None,
                                          q_len, kv_len, source)
        if kind == "stored_and_structured":
            mask = mask.restrict(mask_mod)
    return mask, np.asarray(mask.to_dense()), target


# Each draw builds a BlockMask (seconds on a busy CI machine): not a slow strategy.
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(block_mask_pairs())
def test_regrouped_mask_admits_the_same_elements(pair):
    mask, expected, target = pair
    regrouped = regroup(mask, target)
    assert regrouped.block_size == target
    check_block_mask(regrouped, np.broadcast_to(expected, (expected.shape[0], 1,
                                                           *expected.shape[2:])))


def test_regrouped_causal_mask_keeps_its_skips_and_full_tiles():
    """Causal 64 x 64 to 128 x 128: tiles above the diagonal skipped, below it FULL,
    the diagonal COMPUTED from indices (no stored tile), as if built at 128."""
    mask = omni_jax.create_block_mask(omni_jax.causal_mask, None, None, 512, 512, 64)
    regrouped = regroup(mask, (128, 128))
    direct = omni_jax.create_block_mask(omni_jax.causal_mask, None, None, 512, 512, 128)
    np.testing.assert_array_equal(regrouped.tile_flags(), direct.tile_flags())
    flags = np.asarray(regrouped.tile_flags())
    assert (flags[0, 0][np.triu_indices(4, 1)] == MASKED).all()
    assert (flags[0, 0][np.tril_indices(4, -1)] == FULL).all()
    assert regrouped.contiguous_full


def test_a_mask_of_the_target_size_is_returned_as_is():
    mask = omni_jax.create_block_mask(omni_jax.causal_mask, None, None, 256, 256, 128)
    assert regroup(mask, (128, 128)) is mask


def test_traced_masks_are_not_regrouped():
    def build(ids):
        mask = omni_jax.create_block_mask(omni_jax.document_mask(ids), 1, None, 128, 128, 64)
        assert "traced" in regroupable(mask, (128, 128))
        with pytest.raises(ValueError, match="traced"):
            regroup(mask, (128, 128))
        return ids

    jax.jit(build)(jnp.zeros((1, 128), jnp.int32))


def test_the_planner_retiles_only_where_the_backend_declines_the_size(monkeypatch):
    """Mosaic takes 128-row q tiles: (64, 64) and (256, 128) masks are served at
    Mosaic's block size at head dim 64, (128, 128), forward and backward; a (128, 64)
    mask keeps its own."""
    monkeypatch.setenv(runtime.INTERPRET_ENV_VAR, "1")
    plans = record_plans(monkeypatch)
    q = jax.ShapeDtypeStruct((1, 256, 2, 64), jnp.bfloat16)
    for size, expected in (((64, 64), (128, 128)), ((128, 64), (128, 64)),
                           ((256, 128), (128, 128))):
        mask = omni_jax.create_block_mask(omni_jax.causal_mask, None, None, 256, 256, size)
        jax.eval_shape(jax.grad(lambda q, mask=mask: omni_jax.attention(
            q, q, q, mask=mask, implementation="mosaic").astype(jnp.float32).sum()), q)
        plan = plans[-1]
        assert (plan.forward.name, plan.backward.name) == ("mosaic", "mosaic"), size
        assert plan.problem.block_size == expected, size


def test_triton_serves_masks_of_blocks_below_its_smallest_tile(monkeypatch):
    """Triton tiles need 16 rows: an (8, 8) mask is re-tiled to Triton's own size."""
    monkeypatch.setenv(runtime.INTERPRET_ENV_VAR, "1")
    plans = record_plans(monkeypatch)
    q = jax.ShapeDtypeStruct((1, 96, 2, 32), jnp.float32)
    mask = omni_jax.create_block_mask(omni_jax.causal_mask, None, None, 96, 96, 8)
    jax.eval_shape(lambda q: omni_jax.attention(q, q, q, mask=mask, implementation="triton"), q)
    assert plans[-1].forward.name == "triton"
    assert plans[-1].problem.block_size == (128, 128)


@pytest.fixture
def _interpreted(monkeypatch):
    yield from interpreted_mosaic(monkeypatch)


@pytest.mark.interpreted
@pytest.mark.parametrize("block_mask", ["generic", "prefix_lm"])
def test_mosaic_serves_a_64_by_64_mask(block_mask, monkeypatch, _interpreted):
    """FlexAttention-sized masks through the Mosaic kernels, forward and gradients
    against the float64 reference."""
    plans = record_plans(monkeypatch)
    case = Case(f"{block_mask}_64", batch=1, q_len=160, kv_len=192, heads=2, kv_heads=1,
                head_dim=64, block_mask=block_mask)
    check_case("mosaic", case, "bfloat16", (64, 64))
    assert {(p.forward.name, p.backward.name) for p in plans} == {("mosaic", "mosaic")}

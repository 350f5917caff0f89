"""score_mod_on_refs: captured arrays read through refs give what the plain score_mod gives."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl

from omni_jax.scores import apply_score_mod, convert_score_mod, primitive_names
from pallas_kernels.captured import score_mod_on_refs

_RNG = np.random.default_rng(0)
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

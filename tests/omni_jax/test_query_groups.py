"""Grouped-query attention with few queries, each group's heads packed into rows
(`omni_jax.query_groups`): when it applies, and that it computes what the unpacked call
does, gradients, sinks, lse and traced masks included."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import omni_jax
from omni_jax import query_groups
from omni_jax.flax.cache import decode_mask
from omni_jax.problem import AttentionProblem
from tests.forced_configs import record_plans


def _problem(q_len=1, heads=8, kv_heads=2, score_mod=None) -> AttentionProblem:
    return AttentionProblem(batch=2, q_len=q_len, kv_len=300, num_q_heads=heads,
                            num_kv_heads=kv_heads, head_dim=32, head_dim_v=32,
                            dtype=np.dtype("float32"), scale=0.2, softcap=None,
                            score_mod=score_mod, has_sinks=True, has_user_mask=False)


@pytest.mark.parametrize(("problem", "mask_heads", "group"), [
    (_problem(), None, 4),
    (_problem(q_len=127), 1, 4),
    (_problem(q_len=128), None, 1),  # a full tile of queries per head already
    (_problem(kv_heads=8), None, 1),  # no groups
    (_problem(score_mod=object()), None, 1),  # score_mod reads head and query index
    (_problem(), 8, 1),  # a mask per head
])
def test_packing_group(problem, mask_heads, group):
    mask = None if mask_heads is None else omni_jax.create_block_mask(
        lambda b, h, q, k: k <= q + h, None, mask_heads, problem.q_len, problem.kv_len)
    assert query_groups.packing_group(problem, mask) == group
    packed = query_groups.packed_problem(problem, group)
    assert (packed.q_len, packed.num_q_heads) == (
        (problem.q_len, problem.num_q_heads) if group == 1
        else (problem.q_len * group, problem.num_kv_heads))


def test_rows_hold_the_heads_of_a_group():
    q = jax.random.normal(jax.random.key(0), (2, 3, 8, 5))
    packed = query_groups.pack_queries(q, 4)
    assert packed.shape == (2, 12, 2, 5)
    # Row t * 4 + g of kv head j is query t of head j * 4 + g.
    np.testing.assert_array_equal(packed[:, 2 * 4 + 1, 1], q[:, 2, 1 * 4 + 1])
    lse = jnp.moveaxis(packed[..., 0], 1, 2)  # any [B, Hkv, Sq * G] array
    out, unpacked_lse = query_groups.unpack(packed, lse, 4)
    np.testing.assert_array_equal(out, q)
    np.testing.assert_array_equal(unpacked_lse, jnp.moveaxis(q[..., 0], 1, 2))


def _masks(q_len: int, kv_len: int, offsets: np.ndarray):
    """Mask arguments of `omni_jax.attention` a decoding step may pass."""
    ids = np.minimum(np.arange(kv_len) // 97, 2)[None].repeat(2, 0)
    return {
        "none": {},
        "decode": {"mask": decode_mask(jnp.asarray(offsets), q_len, kv_len)},
        "decode_window": {"mask": decode_mask(jnp.asarray(offsets), q_len, kv_len, 40)},
        "causal_window": {"is_causal": True, "local_window_size": (3, 0)},
        "documents": {"q_segment_ids": jnp.asarray(ids[:, :q_len]),
                      "kv_segment_ids": jnp.asarray(ids)},
        "stored_tiles": {"mask": omni_jax.create_block_mask(
            lambda b, h, q, k: (k * 7 + q) % 5 != 0, None, None, q_len, kv_len)},
    }


@pytest.mark.parametrize("q_len", [1, 5])
@pytest.mark.parametrize("masks", ["none", "decode", "decode_window", "causal_window",
                                   "documents", "stored_tiles"])
def test_packed_call_matches_unpacked(monkeypatch, q_len, masks):
    rng = np.random.default_rng()
    kv_len, heads, kv_heads = 300, 8, 2
    offsets = rng.integers(0, kv_len - q_len + 1, 2).astype(np.int32)
    kwargs = _masks(q_len, kv_len, offsets)[masks]
    with jax.enable_x64(True):
        q = jnp.asarray(rng.standard_normal((2, q_len, heads, 16)))
        k, v = (jnp.asarray(rng.standard_normal((2, kv_len, kv_heads, 16))) for _ in "kv")
        sinks = jnp.asarray(rng.standard_normal(heads))
        cotangents = (jnp.asarray(rng.standard_normal((2, q_len, heads, 16))),
                      jnp.asarray(rng.standard_normal((2, heads, q_len))))

        def run(q, k, v, sinks):
            return jax.vjp(lambda *a: omni_jax.attention(
                *a[:3], sinks=a[3], return_lse=True, implementation="xla", **kwargs),
                q, k, v, sinks)

        plans = record_plans(monkeypatch)
        (out, lse), vjp = run(q, k, v, sinks)
        grads = vjp(cotangents)
        monkeypatch.setattr(query_groups, "PACK_BELOW_Q_LEN", 0)
        (ref_out, ref_lse), ref_vjp = run(q, k, v, sinks)
        assert [plan.problem.num_q_heads for plan in plans] == [kv_heads, heads]
        for got, want in zip((out, lse, *grads), (ref_out, ref_lse, *ref_vjp(cotangents)),
                             strict=True):
            np.testing.assert_allclose(got, want, rtol=1e-10, atol=1e-12)


def test_decode_step_under_jit_and_vmap():
    """A traced cache position (the decode loop's carry) and a vmapped batch of steps."""
    rng = np.random.default_rng()
    q = jnp.asarray(rng.standard_normal((3, 2, 1, 8, 16)), jnp.float32)
    k, v = (jnp.asarray(rng.standard_normal((3, 2, 200, 2, 16)), jnp.float32) for _ in "kv")
    offsets = jnp.asarray(rng.integers(0, 200, (3, 2)), jnp.int32)

    @jax.jit
    @jax.vmap
    def step(q, k, v, offsets):
        return omni_jax.attention(q, k, v, mask=decode_mask(offsets, 1, 200),
                                  implementation="xla")

    out = step(q, k, v, offsets)
    visible = np.arange(200)[None, None] <= np.asarray(offsets)[..., None]  # [3, 2, 200]
    scores = jnp.einsum("nbqhd,nbkhd->nbhqk", q, jnp.repeat(k, 4, axis=3)) / 4.0
    scores = jnp.where(visible[:, :, None, None], scores, -jnp.inf)
    expected = jnp.einsum("nbhqk,nbkhd->nbqhd", jax.nn.softmax(scores, -1),
                          jnp.repeat(v, 4, axis=3))
    np.testing.assert_allclose(out, expected, rtol=2e-5, atol=2e-5)

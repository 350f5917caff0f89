"""Eager calls (no jit around them) compile once per static configuration and shapes.

Without that, every eager call of a Pallas kernel recompiled it: 3.1 s per
`omni_jax.attention` call on an H100 against 0.14 ms jitted (2026-11-25).
"""

from __future__ import annotations

import importlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import omni_jax
from omni_jax.matmul import api as matmul_api
from omni_jax.matmul import implementations
from omni_jax.sparse_mla import api as sparse_mla_api
from pallas_kernels.mosaic import matmul_sm90

# The package exports the function `attention` under the module's name.
attention_module = importlib.import_module("omni_jax.attention")


def _compiles(jitted, call, times: int = 3) -> int:
    """New entries in ``jitted``'s cache over ``times`` calls of ``call``.

    JAX's caches are emptied first: its jit cache holds at most 8192 entries of all
    functions, and once a long test session has filled it, new entries evict old ones
    and the count stays put (every count here read 0 in a CI run of 1300 tests)."""
    jax.clear_caches()
    before = jitted._cache_size()
    for _ in range(times):
        jax.block_until_ready(call())
    return jitted._cache_size() - before


def _qkv(seed, q_len=48, heads=2):
    rng = np.random.default_rng(seed)
    return [jnp.asarray(rng.standard_normal((1, q_len, heads, 32)), jnp.float32)
            for _ in range(3)]


@pytest.mark.parametrize("mask_kind", ["none", "causal_window", "segments", "block_mask",
                                       "new_document_mask", "score_mod"])
def test_attention_compiles_once(mask_kind, seed):
    q, k, v = _qkv(seed)
    rng = np.random.default_rng(seed + 1)

    def kwargs():
        # Fresh arguments at every call, as a loop would build them.
        if mask_kind == "causal_window":
            return dict(is_causal=True, local_window_size=[16, 0])
        if mask_kind == "segments":
            return dict(q_segment_ids=jnp.asarray(np.sort(rng.integers(0, 3, (1, 48))),
                                                  jnp.int32))
        if mask_kind == "block_mask":
            return dict(mask=omni_jax.create_block_mask(
                lambda b, h, i, j: i >= j, 1, 1, 48, 48, block_size=16))
        if mask_kind == "new_document_mask":  # other values, same structure and shapes
            ids = jnp.asarray(np.sort(rng.integers(0, 3, (1, 48))), jnp.int32)
            return dict(mask=omni_jax.create_block_mask(omni_jax.document_mask(ids), 1, None,
                                                        48, 48, block_size=16))
        if mask_kind == "score_mod":
            slopes = jnp.asarray(rng.standard_normal(2), jnp.float32)
            return dict(score_mod=lambda s, b, h, i, j: s - slopes[h] * (i - j))
        return {}

    compiles = _compiles(attention_module._masked_attention,
                         lambda: omni_jax.attention(q, k, v, implementation="xla", **kwargs()))
    assert compiles == 1


def test_attention_recompiles_for_a_different_score_mod(seed):
    q, k, v = _qkv(seed)
    mods = [lambda s, b, h, i, j: s * 0.5, lambda s, b, h, i, j: s + 1.0]
    calls = iter(mods * 2)
    compiles = _compiles(attention_module._masked_attention,
                         lambda: omni_jax.attention(q, k, v, score_mod=next(calls),
                                                    implementation="xla"), times=4)
    assert compiles == 2


def test_matmul_compiles_once(seed):
    a = jnp.asarray(np.random.default_rng(seed).standard_normal((40, 24)), jnp.float32)
    b = jnp.asarray(np.random.default_rng(seed + 1).standard_normal((24, 8)), jnp.float32)
    jitted = matmul_api._differentiable(matmul_api._Spec(
        False, False, "gelu", jnp.dtype(jnp.float32), "xla", implementations.trace_state()))
    assert _compiles(jitted, lambda: omni_jax.matmul(a, b, activation="gelu",
                                                     implementation="xla")) == 1


def test_matmul_traces_afresh_after_autotuning(monkeypatch, seed):
    """Autotuned configs are read while tracing: a new winner must not meet a call
    compiled before it."""
    a = jnp.asarray(np.random.default_rng(seed).standard_normal((16, 16)), jnp.float32)
    before = implementations.trace_state()
    omni_jax.matmul(a, a, implementation="xla")
    entries = matmul_api._differentiable.cache_info().currsize
    monkeypatch.setitem(matmul_sm90._TUNED, ("a tuning key",), matmul_sm90.MatmulConfig())
    assert implementations.trace_state() != before
    omni_jax.matmul(a, a, implementation="xla")
    assert matmul_api._differentiable.cache_info().currsize == entries + 1


def test_sparse_mla_compiles_once(seed):
    rng = np.random.default_rng(seed)
    q = jnp.asarray(rng.standard_normal((3, 64, 80)), jnp.bfloat16)
    kv = jnp.asarray(rng.standard_normal((50, 1, 80)), jnp.bfloat16)
    indices = jnp.asarray(rng.integers(-4, 54, (3, 1, 64)), jnp.int32)
    compiles = _compiles(sparse_mla_api._jitted_prefill, lambda: omni_jax.sparse_mla_prefill(
        q, kv, indices, sm_scale=0.1, d_v=64, implementation="xla"))
    assert compiles == 1


def test_create_block_mask_compiles_once_per_mask_structure(seed):
    """New closures over new arrays, one structure: one compile, and each mask its own."""
    rng = np.random.default_rng(seed)
    construct = importlib.import_module("omni_jax.masks.construct")
    construct._tile_flags.cache_clear()
    construct._tiles.cache_clear()
    for _ in range(3):
        ids = jnp.asarray(np.sort(rng.integers(0, 4, (1, 90))), jnp.int32)
        mask = omni_jax.create_block_mask(lambda b, h, i, j, ids=ids: ids[b, i] == ids[b, j],
                                          1, None, 90, 90, block_size=16)
        expected = np.asarray(ids)[0][:, None] == np.asarray(ids)[0][None, :]
        np.testing.assert_array_equal(np.asarray(mask.to_dense())[0, 0], expected)
    assert construct._tile_flags.cache_size() == 1 and construct._tiles.cache_size() <= 1

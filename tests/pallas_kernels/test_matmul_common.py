"""The pieces every GEMM kernel shares: activations, tile order, batch broadcasting."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import matmul_common as common


def test_portable_erf_matches_float64():
    x = np.linspace(-9.0, 9.0, 20001, dtype=np.float32)
    expected = np.array([math.erf(v) for v in x.astype(np.float64)])
    assert np.max(np.abs(np.asarray(common.erf(jnp.asarray(x)), np.float64) - expected)) < 5e-7


@pytest.mark.parametrize("name,reference", [
    ("gelu", lambda x: jax.nn.gelu(x, approximate=False)),
    ("gelu_tanh", lambda x: jax.nn.gelu(x, approximate=True)),
    ("silu", jax.nn.silu),
    ("relu", jax.nn.relu),
])
def test_activations_and_derivatives_match_jax(name, reference):
    """Values and derivatives, the latter out to +-1e5 (the backward pass differentiates
    these functions: silu's derivative was NaN below -88)."""
    x = jnp.concatenate([jnp.linspace(-30.0, 30.0, 4001, dtype=jnp.float32),
                         jnp.array([-1e5, -1e3, -100.0, 100.0, 1e3, 1e5], jnp.float32)])
    activation = common.ACTIVATIONS[name]
    np.testing.assert_allclose(activation(x), reference(x), rtol=2e-6, atol=2e-6)
    derivative = jax.vmap(jax.grad(activation))(x)
    # gelu's erf is a rational fit, clipped at +-4: its derivative is off by up to 7e-6 there.
    np.testing.assert_allclose(derivative, jax.vmap(jax.grad(reference))(x), rtol=2e-6,
                               atol=1e-5)


@pytest.mark.parametrize("m_tiles,n_tiles,group_m", [(1, 1, 8), (5, 3, 2), (7, 9, 4), (3, 4, 8)])
def test_grouped_order_visits_every_tile_once(m_tiles, n_tiles, group_m):
    ids = jnp.arange(m_tiles * n_tiles)
    mi, ni = common.grouped_tile(ids, m_tiles, n_tiles, group_m)
    assert sorted(zip(np.asarray(mi).tolist(), np.asarray(ni).tolist(), strict=True)) == [
        (i, j) for i in range(m_tiles) for j in range(n_tiles)]


def test_operand_batch_index_broadcasts_size_one_dims():
    batch_shape, operand = (2, 3, 4), (2, 1, 4)
    for flat in range(24):
        i, _, k = np.unravel_index(flat, batch_shape)
        expected = np.ravel_multi_index((i, 0, k), operand)
        assert int(common.operand_batch_index(jnp.int32(flat), batch_shape, operand)) == expected

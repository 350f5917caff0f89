"""The linen wrapper: same parameters and outputs as the plain-JAX reference layer."""

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from omni_jax.flax import linen as omni_linen
from omni_jax.flax import segment_positions
from tests.omni_jax.flax.reference_layer import reference_layer
from tests.reference import dense_mask, relative_error

SEGMENTS = np.array([[1] * 6 + [2] * 10, [1] * 16], np.int32)


def test_linen_attention_matches_reference_and_trains(seed):
    module = omni_linen.Attention(num_heads=4, in_features=32, num_kv_heads=2, qk_norm=True,
                                  learnable_sinks=True, softcap=8.0, implementation="xla")
    x = jax.random.normal(jax.random.key(seed), (2, 16, 32))
    segments = jnp.asarray(SEGMENTS)
    variables = module.init(jax.random.key(seed + 1), x, is_causal=True, segment_ids=segments)
    params = variables["params"]["attention"]
    # Random sinks and norm scales, so they are really used.
    params["sinks"] = jax.random.normal(jax.random.key(seed + 2), (4,))
    params["query_norm"]["scale"] = 1 + jax.random.normal(jax.random.key(seed + 3), (8,)) / 2
    out = module.apply(variables, x, is_causal=True, segment_ids=segments)

    flat = {"/".join(path): np.asarray(value, np.float64)
            for path, value in flax.traverse_util.flatten_dict(params).items()}
    with jax.enable_x64(True):
        expected = reference_layer(
            flat, np.asarray(x), positions=np.asarray(segment_positions(segments)),
            mask=dense_mask(2, 4, 16, 16, is_causal=True, q_segment_ids=SEGMENTS,
                            kv_segment_ids=SEGMENTS), rope_base=10_000.0, softcap=8.0)
    assert relative_error(out, expected) < 2e-5

    grads = jax.jit(jax.grad(lambda v: module.apply(v, x, is_causal=True).sum()))(variables)
    assert all(np.all(np.isfinite(g)) for g in jax.tree.leaves(grads))


def test_linen_attention_takes_the_projection_initialisers(seed):
    module = omni_linen.Attention(num_heads=2, in_features=16, use_bias=True,
                                  kernel_init=nn.initializers.constant(0.5),
                                  bias_init=nn.initializers.constant(-0.25))
    x = jax.random.normal(jax.random.key(seed), (1, 4, 16))
    params = module.init(jax.random.key(seed + 1), x)["params"]["attention"]
    for name in ("query", "key", "value", "out"):
        np.testing.assert_array_equal(params[name]["kernel"], 0.5)
        np.testing.assert_array_equal(params[name]["bias"], -0.25)

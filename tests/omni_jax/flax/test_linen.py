"""The linen wrapper: same parameters and outputs as the plain-JAX reference layer."""

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

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


def test_linen_decode_matches_the_whole_sequence(seed):
    module = omni_linen.Attention(num_heads=4, in_features=32, num_kv_heads=2, qk_norm=True,
                                  implementation="xla")
    x = jax.random.normal(jax.random.key(seed), (2, 16, 32))
    variables = module.init(jax.random.key(seed + 1), x, is_causal=True, decode=True)
    assert variables["cache"]["attention"]["cached_key"].shape == (2, 16, 2, 8)
    expected = module.apply({"params": variables["params"]}, x, is_causal=True)

    step = jax.jit(lambda v, x: module.apply(v, x, is_causal=True, decode=True,
                                             mutable=["cache"]))
    outputs, cache = [], variables["cache"]
    for start, end in ((0, 10), *((i, i + 1) for i in range(10, 16))):
        out, updated = step({"params": variables["params"], "cache": cache}, x[:, start:end])
        outputs.append(out)
        cache = updated["cache"]
    np.testing.assert_array_equal(cache["attention"]["cache_index"], [16, 16])
    assert relative_error(jnp.concatenate(outputs, axis=1), expected) < 1e-5


def test_linen_decode_errors_name_what_is_missing(seed):
    module = omni_linen.Attention(num_heads=2, in_features=16, implementation="xla")
    x = jax.random.normal(jax.random.key(seed), (1, 8, 16))
    plain = module.init(jax.random.key(seed + 1), x)
    with pytest.raises(ValueError, match="init the module with decode=True"):
        module.apply(plain, x[:, :1], decode=True, mutable=["cache"])
    cached = module.init(jax.random.key(seed + 1), x, decode=True)
    with pytest.raises(ValueError, match="mutable=\\['cache'\\]"):
        module.apply(cached, x[:, :1], decode=True)

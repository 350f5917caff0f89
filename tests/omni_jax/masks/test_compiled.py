"""Mask functions compiled whole: concrete results where eager ops would give them, staged
ops inside a trace, one trace per signature."""

import jax
import jax.numpy as jnp
import numpy as np

import omni_jax
from omni_jax.masks.compiled import compiled_when_concrete


def _counting_function():
    traces = []

    @compiled_when_concrete(static_argnames=("shift",))
    def sorted_plus(x, *, shift):
        traces.append(x.shape)
        return jnp.sort(x) + shift

    return sorted_plus, traces


def test_concrete_calls_trace_once_per_signature():
    sorted_plus, traces = _counting_function()
    for values in ([3, 1, 2], [9, 7, 8]):
        out = sorted_plus(np.asarray(values, np.int32), shift=1)
        assert not isinstance(out, jax.core.Tracer)
        np.testing.assert_array_equal(out, np.sort(values) + 1)
    sorted_plus(np.zeros(4, np.int32), shift=1)
    sorted_plus(np.zeros(4, np.int32), shift=2)
    assert traces == [(3,), (4,), (4,)]


def test_inside_a_trace_concrete_only_under_compile_time_eval():
    sorted_plus, _ = _counting_function()
    x = np.asarray([2, 1], np.int32)

    def staged(y):
        out = sorted_plus(x, shift=0)
        assert isinstance(out, jax.core.Tracer)
        with jax.ensure_compile_time_eval():
            eager = sorted_plus(x, shift=0)
        assert not isinstance(eager, jax.core.Tracer)
        np.testing.assert_array_equal(eager, [1, 2])
        return y + out + sorted_plus(y, shift=0)

    np.testing.assert_array_equal(jax.jit(staged)(x), [4, 5])


def test_a_constant_mask_built_inside_jit_stays_traced():
    """A mask built inside jit is part of the traced program (a large one would otherwise
    become a large constant); built outside, it is concrete."""
    build = lambda: omni_jax.create_block_mask(omni_jax.causal_mask, None, None, 256, 256)

    def inside(x):
        assert isinstance(build().kv_indices, jax.core.Tracer)
        return x

    jax.jit(inside)(0)
    assert not isinstance(build().kv_indices, jax.core.Tracer)


def test_a_mask_mod_mask_under_compile_time_eval_is_concrete_inside_jit():
    """An evaluated mask_mod's mask built inside jit under `jax.ensure_compile_time_eval`
    is concrete, as outside jit, and equal to the one built there."""
    prefix = jnp.asarray([40, 100], jnp.int32)

    def build():
        prefix_lm = lambda b, h, q_idx, kv_idx: (kv_idx <= q_idx) | (kv_idx < prefix[b])
        return omni_jax.create_block_mask(prefix_lm, 2, None, 200, 200, block_size=64)

    outside = build()
    seen = []

    def inside(x):
        with jax.ensure_compile_time_eval():
            mask = build()
        seen.append(mask)
        return x

    jax.jit(inside)(0)
    for leaf_in, leaf_out in zip(jax.tree.leaves(seen[0]), jax.tree.leaves(outside),
                                 strict=True):
        assert not isinstance(leaf_in, jax.core.Tracer)
        np.testing.assert_array_equal(leaf_in, leaf_out)
    np.testing.assert_array_equal(outside.to_dense(), seen[0].to_dense())

"""The public ops on arrays sharded along Explicit mesh axes (sharding in types).

Without `omni_jax.explicit_sharding` their gathers and backward contractions raise
`ShardingTypeError`; now they run as under a plain jit and give their results the
sharding the inputs imply.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import omni_jax
from omni_jax import explicit_sharding
from pallas_kernels import runtime
from tests.jax_releases import skip_unless_triton_lowers_here
from tests.omni_jax.test_shard_map import CUSTOM_CALLS, _attention_inputs
from tests.reference import relative_error


@pytest.fixture
def mesh():
    if len(jax.devices()) < 2:
        pytest.skip("needs two devices (tests/conftest.py asks XLA for two host devices)")
    mesh = jax.make_mesh((2,), ("data",), axis_types=(jax.sharding.AxisType.Explicit,),
                         devices=jax.devices()[:2])
    with jax.set_mesh(mesh):
        yield mesh


def _check(fn, args, specs, want_specs):
    """``fn`` on ``args`` placed by ``specs`` matches ``fn`` on unsharded ``args``, and its
    results are sharded as ``want_specs``."""
    sharded = [jax.device_put(x, spec) for x, spec in zip(args, specs, strict=True)]
    got = jax.jit(fn)(*sharded)
    want = jax.jit(fn)(*args)
    for g, w, spec in zip(got, want, want_specs, strict=True):
        assert relative_error(g, w) < 1e-5
        assert jax.typeof(g).sharding.spec == spec


def _attention_grad(implementation="xla"):
    def loss(q, k, v, sinks, ids):
        out = omni_jax.attention(q, k, v, is_causal=True, sinks=sinks, q_segment_ids=ids,
                                 score_mod=lambda s, b, h, i, j: s - 0.1 * h * (i - j),
                                 implementation=implementation)
        return (out.astype(jnp.float32) ** 2).sum(), out

    def grad(*args):
        (_, out), grads = jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True)(*args)
        return out, *grads

    return grad


def test_attention(mesh, seed):
    rng = np.random.default_rng(seed)
    q, k, v = (jnp.asarray(rng.standard_normal((4, 40, 2, 16)), jnp.float32) for _ in range(3))
    sinks = jnp.asarray(rng.standard_normal(2), jnp.float32)
    ids = jnp.asarray(np.sort(rng.integers(0, 3, (4, 40)), axis=1), jnp.int32)
    batch = P("data")
    _check(_attention_grad(), (q, k, v, sinks, ids), (batch, batch, batch, P(), batch),
           (P("data", None, None, None),) * 4 + (P(None),))


def test_attention_lse_follows_query(mesh, seed):
    rng = np.random.default_rng(seed)
    q = jax.device_put(jnp.asarray(rng.standard_normal((2, 32, 4, 8)), jnp.float32),
                       P(None, None, "data"))  # heads sharded
    out, lse = jax.jit(lambda q: omni_jax.attention(q, q, q, return_lse=True,
                                                    implementation="xla"))(q)
    assert jax.typeof(out).sharding.spec == P(None, None, "data", None)
    assert jax.typeof(lse).sharding.spec == P(None, "data", None)


def test_attention_with_block_masks_built_under_the_mesh(mesh, seed):
    """A concrete BlockMask built under the explicit mesh, and one built inside the jit
    from a traced (replicated) capture: prefix-LM with per-example prefix lengths."""
    rng = np.random.default_rng(seed)
    q, k, v = (jnp.asarray(rng.standard_normal((4, 64, 2, 16)), jnp.float32) for _ in range(3))
    prefix = jnp.asarray(rng.integers(0, 64, 4), jnp.int32)

    def block_mask(prefix):
        mask_mod = lambda b, h, i, j: (j <= i) | (j < prefix[b])
        return omni_jax.create_block_mask(mask_mod, 4, None, 64, 64, block_size=16)

    def traced(q, k, v, prefix):
        return omni_jax.attention(q, k, v, mask=block_mask(prefix), implementation="xla"),

    concrete_mask = block_mask(prefix)

    def concrete(q, k, v, prefix):
        return omni_jax.attention(q, k, v, mask=concrete_mask, implementation="xla"),

    for fn in (traced, concrete):
        _check(fn, (q, k, v, prefix), (P("data"), P("data"), P("data"), P()),
               (P("data", None, None, None),))


def test_matmul(mesh, seed):
    rng = np.random.default_rng(seed)
    a = jnp.asarray(rng.standard_normal((64, 48)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((48, 40)), jnp.float32)
    bias = jnp.asarray(rng.standard_normal(40), jnp.float32)

    def grad(a, w, bias):  # the backward contracts over the sharded rows
        loss = lambda *x: (omni_jax.matmul(*x[:2], bias=x[2], activation="gelu",
                                           implementation="xla") ** 2).sum()
        return jax.grad(loss, argnums=(0, 1, 2))(a, w, bias)

    _check(grad, (a, w, bias), (P("data"), P(), P()),
           (P("data", None), P(None, None), P(None)))


def test_sparse_mla(mesh, seed):
    rng = np.random.default_rng(seed)
    q = jnp.asarray(rng.standard_normal((8, 4, 32)), jnp.float32)
    kv = jnp.asarray(rng.standard_normal((24, 1, 32)), jnp.float32)
    indices = jnp.asarray(rng.integers(-2, 26, (8, 1, 8)), jnp.int32)

    def fn(q, kv, indices):
        out, _, lse, scores = omni_jax.sparse_mla_prefill(
            q, kv, indices, sm_scale=0.2, d_v=16, return_scores=True, implementation="xla")
        d_q = jax.grad(lambda q: (omni_jax.sparse_mla_prefill(
            q, kv, indices, sm_scale=0.2, d_v=16, implementation="xla")[0] ** 2).sum())(q)
        finite = lambda x: jnp.where(jnp.isfinite(x), x, 0.0)
        return out, finite(lse), finite(scores), d_q

    rows = P("data", None, None)
    _check(fn, (q, kv, indices), (P("data"), P(), P("data")),
           (rows, P("data", None), rows, rows))


def _vmapped(implementation="xla"):
    """attention's and matmul's gradients, vmapped over a leading (sharded) axis: inside
    the vmap an operand's type shows no sharding, the kernels' batched operands would."""

    def grads(q, w):
        def loss(q, w):
            x = omni_jax.matmul(q.reshape(-1, q.shape[-1]), w, implementation=implementation)
            x = x.reshape(q.shape).astype(q.dtype)
            out = omni_jax.attention(x, x, x, is_causal=True, implementation=implementation)
            return (out.astype(jnp.float32) ** 2).sum()

        return jax.grad(loss, argnums=(0, 1))(q, w)

    return jax.vmap(grads, in_axes=(0, None))


def test_vmap_over_a_sharded_axis(mesh, seed):
    rng = np.random.default_rng(seed)
    q = jnp.asarray(rng.standard_normal((4, 2, 40, 2, 16)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((16, 16)) / 4, jnp.float32)
    _check(_vmapped(), (q, w), (P("data"), P()),
           (P("data", None, None, None, None), P("data", None, None)))


@pytest.mark.parametrize("implementation", ["triton", "mosaic"])
def test_kernels_lower_for_cuda(mesh, implementation, compiled_kernels):
    if implementation == "triton":
        skip_unless_triton_lowers_here()
    batch = P("data")
    q = jax.ShapeDtypeStruct((4, 256, 2, 64), jnp.bfloat16, sharding=batch)
    sinks = jax.ShapeDtypeStruct((2,), jnp.float32, sharding=P())
    ids = jax.ShapeDtypeStruct((4, 256), jnp.int32, sharding=batch)
    lowered = jax.jit(_attention_grad(implementation)).trace(q, q, q, sinks, ids).lower(
        lowering_platforms=("cuda",))
    assert lowered.as_text().count(CUSTOM_CALLS[implementation]) >= 3
    q = jax.ShapeDtypeStruct((2, 2, 256, 2, 64), jnp.bfloat16, sharding=batch)
    w = jax.ShapeDtypeStruct((64, 64), jnp.bfloat16, sharding=P())
    lowered = jax.jit(_vmapped(implementation)).trace(q, w).lower(lowering_platforms=("cuda",))
    assert lowered.as_text().count(CUSTOM_CALLS[implementation]) >= 4


@pytest.mark.gpu
@pytest.mark.parametrize("implementation", ["triton", "mosaic"])
def test_kernels_on_gpus(mesh, implementation, seed):
    """The kernels run (on gathered operands) for arrays sharded over two GPUs."""
    if jax.default_backend() != "gpu":
        pytest.skip("needs CUDA GPUs")
    if implementation == "mosaic" and not runtime.can_run_mosaic_hopper():
        pytest.skip("needs sm90 GPUs")
    args = _attention_inputs(np.random.default_rng(seed), jnp.bfloat16, seq=300, head_dim=64)
    batch = P("data")
    _check(_attention_grad(implementation), args,
           (batch, batch, batch, P(), batch),
           (P("data", None, None, None),) * 4 + (P(None),))


def test_unique_keeps_each_axis_once():
    assert explicit_sharding.unique(("data", "data", None)) == P("data", None, None)
    assert explicit_sharding.unique((("data", "model"), "model")) == P(("data", "model"), None)
    assert explicit_sharding.dims(None, 2) == (None, None)

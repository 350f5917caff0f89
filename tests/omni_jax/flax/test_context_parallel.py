"""`omni_jax.flax.Attention(context_axis=...)`: the layer on a sequence sharded over two
devices computes what it computes on the whole sequence, RoPE at global positions."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from omni_jax.context_parallel import unzigzag, zigzag
from omni_jax.flax import Attention
from tests.reference import relative_error


@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
def test_layer_over_two_devices_matches_one(layout, seed):
    if len(jax.devices()) < 2:
        pytest.skip("needs 2 devices")
    mesh = jax.make_mesh((2,), ("seq",), axis_types=(jax.sharding.AxisType.Auto,),
                         devices=jax.devices()[:2])
    options = dict(num_kv_heads=1, learnable_sinks=True, implementation="xla",
                   rngs=nnx.Rngs(seed))
    whole = Attention(4, 32, **options)
    sharded = Attention(4, 32, context_axis="seq", context_layout=layout,
                        **{**options, "rngs": nnx.Rngs(seed)})
    x = jnp.asarray(np.random.default_rng(seed).standard_normal((2, 16, 32)), jnp.float32)
    graphdef, params = nnx.split(sharded)

    def loss(params, x):
        return (nnx.merge(graphdef, params)(x, is_causal=True) ** 2).sum()

    def local(params, x):  # gradients of replicated params come out summed over devices
        value, grads = jax.value_and_grad(loss)(params, x)
        return jax.lax.psum(value, "seq"), grads

    fn = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(P(), P(None, "seq")),
                               out_specs=(P(), P())))
    reorder = (lambda a: zigzag(a, 2)) if layout == "zigzag" else (lambda a: a)
    value, grads = fn(params, reorder(x))
    want_value, want_grads = jax.jit(jax.value_and_grad(
        lambda p, x: (nnx.merge(*nnx.split(whole)[:1], p)(x, is_causal=True) ** 2).sum()))(
        nnx.split(whole)[1], x)
    assert relative_error(value, want_value) < 1e-5
    for got, want in zip(jax.tree.leaves(grads), jax.tree.leaves(want_grads), strict=True):
        assert relative_error(got, want) < 1e-4
    out = jax.jit(jax.shard_map(lambda p, x: nnx.merge(graphdef, p)(x, is_causal=True),
                                mesh=mesh, in_specs=(P(), P(None, "seq")),
                                out_specs=P(None, "seq")))(params, reorder(x))
    restore = (lambda a: unzigzag(a, 2)) if layout == "zigzag" else (lambda a: a)
    assert relative_error(restore(out), whole(x, is_causal=True)) < 1e-5


def test_segment_ids_need_global_positions():
    layer = Attention(2, 8, context_axis="seq", rngs=nnx.Rngs(0))
    mesh = jax.make_mesh((1,), ("seq",), axis_types=(jax.sharding.AxisType.Auto,),
                         devices=jax.devices()[:1])
    x, ids = jnp.ones((1, 4, 8)), jnp.zeros((1, 4), jnp.int32)
    graphdef, params = nnx.split(layer)
    fn = jax.shard_map(lambda p, x, ids: nnx.merge(graphdef, p)(x, segment_ids=ids),
                       mesh=mesh, in_specs=(P(), P(None, "seq"), P(None, "seq")),
                       out_specs=P(None, "seq"))
    with pytest.raises(ValueError, match="pass positions"):
        fn(params, x, ids)

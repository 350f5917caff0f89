"""The XLA backend's memory stays O(seq x block), and attention works on sharded inputs."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec

import omni_jax
from tests.reference import relative_error

SEQ = 65536
DENSE_SCORES_BYTES = SEQ * SEQ * 4  # 16 GiB: what a dense float32 score matrix would take


@pytest.mark.parametrize("differentiate", [False, True], ids=["forward", "forward+backward"])
def test_memory_is_linear_in_sequence_length(differentiate):
    shape = jax.ShapeDtypeStruct((1, SEQ, 1, 64), jnp.bfloat16)
    segment_ids = jax.ShapeDtypeStruct((1, SEQ), jnp.int32)

    def forward(q, k, v, ids):
        return omni_jax.attention(q, k, v, is_causal=True, q_segment_ids=ids,
                                  implementation="xla")

    fn = forward
    if differentiate:
        fn = jax.grad(lambda q, k, v, ids: forward(q, k, v, ids).astype(jnp.float32).sum(),
                      argnums=(0, 1, 2))
    compiled = jax.jit(fn).lower(shape, shape, shape, segment_ids).compile()
    analysis = compiled.memory_analysis()
    if analysis is None:
        pytest.skip("this backend reports no memory analysis")
    temp = analysis.temp_size_in_bytes
    assert temp < 2**30, f"temporary memory {temp / 2**30:.2f} GiB for seq {SEQ}"
    assert temp < DENSE_SCORES_BYTES / 16


def test_sharded_over_batch_and_heads():
    """XLA partitions the portable implementation: the output stays sharded. (A kernel's
    custom call runs on gathered operands under a plain jit; `jax.shard_map` runs it per
    shard, tests/omni_jax/test_shard_map.py.)"""
    devices = np.array(jax.devices()[:2])
    if devices.size < 2:
        pytest.skip("needs two devices (tests/conftest.py asks XLA for two host devices)")
    mesh = jax.sharding.Mesh(devices.reshape(2, 1), ("data", "model"))
    rng = np.random.default_rng()
    q, k, v = (jnp.asarray(rng.standard_normal((4, 48, 4, 16)), jnp.float32) for _ in range(3))
    ids = jnp.asarray(np.sort(rng.integers(0, 3, (4, 48)), axis=1), jnp.int32)
    spec = NamedSharding(mesh, PartitionSpec("data", None, "model", None))
    ids_spec = NamedSharding(mesh, PartitionSpec("data", None))

    def loss(q, k, v, ids):
        out = omni_jax.attention(q, k, v, is_causal=True, q_segment_ids=ids,
                                 implementation="xla")
        return (out ** 2).sum(), out

    grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2), has_aux=True))
    sharded = [jax.device_put(x, spec) for x in (q, k, v)] + [jax.device_put(ids, ids_spec)]
    (dq, dk, dv), out = grad(*sharded)
    (dq_ref, dk_ref, dv_ref), out_ref = grad(q, k, v, ids)
    assert out.sharding.is_equivalent_to(spec, out.ndim)
    for got, want in ((out, out_ref), (dq, dq_ref), (dk, dk_ref), (dv, dv_ref)):
        assert relative_error(got, want) < 1e-5

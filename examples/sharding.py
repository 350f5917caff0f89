"""omni_jax's ops on several devices, three ways, checked against one device.

1. `jax.shard_map` over the batch: each device runs the kernels on its own shard, and the
   gradients of replicated operands (the projection weight, the sinks) are summed over
   the devices. This is how to run the GPU kernels per shard.
2. A plain `jax.jit` on sharded arrays: XLA partitions the portable implementation; a
   kernel's custom call runs on gathered operands.
3. Explicit sharding (`AxisType.Explicit`, shardings in the types): the results carry
   the sharding the inputs imply.

On a CPU it asks XLA for two devices. The kernels (``--implementation triton`` or
``mosaic``) need a GPU here: JAX's Pallas interpreters do not run inside a shard_map.

    python examples/sharding.py [--implementation xla|triton|mosaic]
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=2")

import argparse  # noqa: E402 (after the XLA environment above)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import AxisType, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import omni_jax  # noqa: E402


def loss(x, w, sinks, segment_ids, implementation):
    """One attention block: a shared projection, causal document attention with sinks."""
    # vmap over the batch: one batched GEMM.
    q = jax.vmap(lambda rows: omni_jax.matmul(rows, w, implementation=implementation))(x)
    q = q.reshape(*q.shape[:2], 4, -1)
    out = omni_jax.attention(q, q, q, is_causal=True, q_segment_ids=segment_ids, sinks=sinks,
                             implementation=implementation)
    return jnp.mean(out.astype(jnp.float32) ** 2)


def main(argv=None) -> dict[str, float]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--implementation", default="xla", choices=("xla", "triton", "mosaic"))
    args = parser.parse_args(argv)
    devices = jax.devices()[:2]
    print(f"{len(devices)} devices: {[d.device_kind for d in devices]}")
    rng = np.random.default_rng(0)
    dtype = jnp.float32 if args.implementation == "xla" else jnp.bfloat16
    x = jnp.asarray(rng.standard_normal((4, 128, 256)), dtype)
    w = jnp.asarray(rng.standard_normal((256, 256)) / 16, dtype)
    sinks = jnp.zeros((4,), jnp.float32)
    segment_ids = jnp.asarray(np.sort(rng.integers(0, 3, (4, 128)), axis=1), jnp.int32)
    grad = jax.grad(loss, argnums=(1, 2))
    inputs = (x, w, sinks, segment_ids)
    want = jax.jit(grad, static_argnums=4)(*inputs, args.implementation)

    def error(got):
        return max(float(jnp.linalg.norm((g - r).astype(jnp.float32))
                         / jnp.linalg.norm(r.astype(jnp.float32)))
                   for g, r in zip(got, want, strict=True))

    errors = {}
    batch = P("data")
    specs = (batch, P(), P(), batch)

    # 1. shard_map: the mean over the batch becomes a mean of the per-device means.
    auto = jax.make_mesh((len(devices),), ("data",), axis_types=(AxisType.Auto,),
                         devices=devices)

    def per_shard(x, w, sinks, segment_ids):
        mean_loss = lambda *a: jax.lax.pmean(loss(*a, args.implementation), "data")
        return jax.grad(mean_loss, argnums=(1, 2))(x, w, sinks, segment_ids)

    sharded = jax.jit(jax.shard_map(per_shard, mesh=auto, in_specs=specs,
                                    out_specs=(P(), P())))
    errors["shard_map"] = error(sharded(*inputs))

    # 2. A plain jit on arrays sharded over the batch.
    placed = [jax.device_put(a, NamedSharding(auto, s)) for a, s in zip(inputs, specs, strict=True)]
    errors["jit"] = error(jax.jit(grad, static_argnums=4)(*placed, args.implementation))

    # 3. Explicit sharding: the gradients come back typed as replicated.
    explicit = jax.make_mesh((len(devices),), ("data",), axis_types=(AxisType.Explicit,),
                             devices=devices)
    with jax.set_mesh(explicit):
        placed = [jax.device_put(a, s) for a, s in zip(inputs, specs, strict=True)]
        got = jax.jit(grad, static_argnums=4)(*placed, args.implementation)
        print("explicit: d_w is", jax.typeof(got[0]))
    errors["explicit"] = error(got)

    for name, value in errors.items():
        print(f"{name:>9}: gradients within {value:.1e} of one device")
    return errors


if __name__ == "__main__":
    main()

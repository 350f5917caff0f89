"""Context-parallel attention against the single-device call on the gathered sequence.

`compare` runs one case on ``num_devices`` devices of this process (the test process has
two; `python -m tests.omni_jax.context_parallel.checks N` runs cases on N virtual CPU
devices in a process of its own), or on as many lanes of a `jax.vmap` with the same axis
name, where the Pallas interpreters run the kernels on the CPU. Each case has fresh random
inputs, and compares out, lse and the gradients of q, k, v and sinks (NaN or a wrong
infinity never passes).
"""

from __future__ import annotations

import itertools
import sys
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

import omni_jax
from omni_jax.context_parallel import unzigzag, zigzag
from tests.reference import relative_error

SHARD_LEN = 8  # query/key positions per device
HEADS = 4


def _documents(rng, batch: int, length: int, num_devices: int, shard_len: int) -> dict:
    """Sorted segment ids with documents spanning shard boundaries."""
    ids = np.sort(rng.integers(0, num_devices + 1, (batch, length)), axis=1)
    return {"q_segment_ids": ids}


def _blind_rows(rng, batch: int, length: int, num_devices: int, shard_len: int) -> dict:
    """Key ids a query shard never matches: the second device's queries (and scattered
    rows elsewhere) see no key at all (zeros, lse -inf, zero gradients)."""
    kv_ids = rng.integers(0, 3, (batch, length))
    q_ids = rng.integers(0, 4, (batch, length))  # id 3: no key
    q_ids[:, shard_len:2 * shard_len] = 3
    return {"q_segment_ids": q_ids, "kv_segment_ids": kv_ids}


# name -> (attention keyword arguments, kv heads, segment ids builder or None, sinks)
CASES: dict[str, tuple[dict, int, Any, bool]] = {
    "causal_gqa_softcap_sinks": ({"is_causal": True, "softcap": 3.0}, 2, None, True),
    "window": ({"local_window_size": (5, 3)}, HEADS, None, False),
    "causal_documents": ({"is_causal": True}, HEADS, _documents, True),
    "blind_rows_mqa": ({"local_window_size": (9, 0)}, 1, _blind_rows, False),
}
STRATEGIES = ("ring", "allgather")
LAYOUTS = ("contiguous", "zigzag")


def _inputs(case: str, num_devices: int, dtype: Any, seed: int, shard_len: int,
            batch: int, dim: int = 8) -> tuple:
    kwargs, kv_heads, ids_builder, with_sinks = CASES[case]
    rng = np.random.default_rng(seed)
    length = num_devices * shard_len
    q = jnp.asarray(rng.standard_normal((batch, length, HEADS, dim)), dtype)
    k, v = (jnp.asarray(rng.standard_normal((batch, length, kv_heads, dim)), dtype)
            for _ in range(2))
    sinks = jnp.asarray(rng.standard_normal(HEADS), dtype) if with_sinks else None
    ids = {} if ids_builder is None else {
        name: jnp.asarray(value, jnp.int32)
        for name, value in ids_builder(rng, batch, length, num_devices, shard_len).items()}
    return (q, k, v, sinks, ids), kwargs


def _loss_and_grads(kwargs: dict, **context: Any):
    """(out, lse, dq, dk, dv, dsinks) of a loss on out and the finite lse."""

    def loss(q, k, v, sinks, ids):
        out, lse = omni_jax.attention(q, k, v, sinks=sinks, return_lse=True, **ids, **kwargs,
                                      **context)
        finite_lse = jnp.where(jnp.isfinite(lse), lse, 0.0)
        return (out.astype(jnp.float32) ** 2).sum() + (finite_lse ** 2).sum(), (out, lse)

    def run(q, k, v, sinks, ids):
        grads, (out, lse) = jax.grad(loss, argnums=(0, 1, 2, 3), has_aux=True)(
            q, k, v, sinks, ids)
        return out, lse, *grads

    return run


def _over_devices(fn, num_devices: int):
    """``fn`` inside a `jax.shard_map` over ``num_devices`` devices: global arrays in and
    out, sequence axes sharded (the sinks and their summed gradient replicated)."""
    mesh = jax.make_mesh((num_devices,), ("seq",), axis_types=(jax.sharding.AxisType.Auto,),
                         devices=jax.devices()[:num_devices])
    seq = P(None, "seq")

    def call(q, k, v, sinks, ids):
        in_specs = (seq, seq, seq, P(), {name: seq for name in ids})
        out_specs = (seq, P(None, None, "seq"), seq, seq, seq, P())
        return jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs)(
            q, k, v, sinks, ids)

    return call


def _over_a_vmap_axis(fn, num_devices: int):
    """``fn`` on ``num_devices`` shards as lanes of a `jax.vmap` with axis name "seq"
    (its collectives included) on one device: the Pallas interpreters run there, unlike
    inside a shard_map."""

    def split(x, axis=1):  # [.., n * L, ..] -> [n, .., L, ..]
        shape = x.shape[:axis] + (num_devices, x.shape[axis] // num_devices) + x.shape[axis + 1:]
        return jnp.moveaxis(x.reshape(shape), axis, 0)

    def join(x, axis=1):
        x = jnp.moveaxis(x, 0, axis)
        return x.reshape(x.shape[:axis] + (-1,) + x.shape[axis + 2:])

    def call(q, k, v, sinks, ids):
        out, lse, dq, dk, dv, dsinks = jax.vmap(fn, in_axes=(0, 0, 0, None, 0),
                                                axis_name="seq")(
            split(q), split(k), split(v), sinks, {name: split(x) for name, x in ids.items()})
        return (join(out), join(lse, 2), join(dq), join(dk), join(dv),
                None if dsinks is None else dsinks.sum(0))  # each lane's own part

    return call


def compare(case: str, num_devices: int, strategy: str, layout: str, *,
            dtype: Any = jnp.float32, implementation: str = "xla", seed: int = 0,
            shard_len: int = SHARD_LEN, batch: int = 2, head_dim: int = 8,
            lanes: bool = False) -> dict[str, float]:
    """Relative errors of out, lse, dq, dk, dv (and dsinks) of the sharded call against
    the single-device call; ``lanes``: shards as lanes of a vmap, not devices."""
    (q, k, v, sinks, ids), kwargs = _inputs(case, num_devices, dtype, seed, shard_len, batch,
                                               head_dim)
    kwargs = {**kwargs, "implementation": implementation}
    want = jax.jit(_loss_and_grads(kwargs))(q, k, v, sinks, ids)
    over = _over_a_vmap_axis if lanes else _over_devices
    sharded = jax.jit(over(_loss_and_grads(kwargs, context_axis="seq",
                                           context_strategy=strategy, context_layout=layout),
                           num_devices))
    if layout == "zigzag":
        reorder = lambda x, axis=1: zigzag(x, num_devices, axis)
        restore = lambda x, axis=1: unzigzag(x, num_devices, axis)
    else:
        reorder = restore = lambda x, axis=1: x
    got = sharded(reorder(q), reorder(k), reorder(v), sinks,
                  {name: reorder(x) for name, x in ids.items()})
    got = (restore(got[0]), restore(got[1], 2), *map(restore, got[2:5]), got[5])
    names = ("out", "lse", "dq", "dk", "dv", "dsinks")
    return {name: relative_error(g, w) for name, g, w in zip(names, got, want, strict=True)
            if w is not None}


def runs(half: int | None = 0) -> list[tuple[str, str, str]]:
    """(case, strategy, layout) of every case and strategy with one layout each,
    alternating so that both layouts meet every case and strategy; ``half`` 0 or 1 picks
    one of the two such sets (together: every combination), None takes both."""
    return [(case, strategy, layout)
            for case, strategy, layout in itertools.product(CASES, STRATEGIES, LAYOUTS)
            if half is None or (STRATEGIES.index(strategy) + list(CASES).index(case) + half)
            % 2 == LAYOUTS.index(layout)]


def main(num_devices: int, seed: int, tolerance: float, half: int | None) -> int:
    """`runs` in float64; prints the errors, 1 on a failure."""
    jax.config.update("jax_enable_x64", True)
    failures = 0
    for case, strategy, layout in runs(half):
        errors = compare(case, num_devices, strategy, layout, dtype=jnp.float64, seed=seed)
        worst = max(errors.values())
        failures += not worst < tolerance
        print(f"{'ok' if worst < tolerance else 'FAIL'} {num_devices} devices {case} "
              f"{strategy} {layout}: " + " ".join(f"{k}={e:.1e}" for k, e in errors.items()))
    return int(failures > 0)


if __name__ == "__main__":
    sys.exit(main(int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3]),
                  None if sys.argv[4] == "all" else int(sys.argv[4])))

"""The Triton and Mosaic kernels per step, run by the Pallas interpreters on the CPU.

The interpreters do not run inside a `jax.shard_map`, so the shards are lanes of a
`jax.vmap` with the context axis name (its ppermute and all_gather included): the same
ring code, the same per-step masks at global positions, the kernels computing.
"""

from __future__ import annotations

import jax.numpy as jnp
import pytest

from tests.omni_jax.context_parallel import checks

# (implementation, case, strategy, layout, dtype, shard length, batch, tolerance). Mosaic's
# interpreter has IO effects, which JAX cannot vmap through a lax.cond: its cases are
# ones where every step has work on every device (no cond).
RUNS = [
    ("triton", "causal_documents", "ring", "contiguous", jnp.float32, 32, 2, 1e-5),
    ("triton", "blind_rows_mqa", "allgather", "zigzag", jnp.float32, 32, 2, 1e-5),
    ("mosaic", "causal_gqa_softcap_sinks", "ring", "zigzag", jnp.bfloat16, 64, 1, 2e-2),
]


@pytest.mark.interpreted
@pytest.mark.parametrize(("implementation", "case", "strategy", "layout", "dtype", "shard_len",
                          "batch", "tolerance"), RUNS,
                         ids=["-".join(run[:4]) for run in RUNS])
def test_kernels_match_one_device(implementation, case, strategy, layout, dtype, shard_len,
                                  batch, tolerance, seed, interpret_pallas_without_gpu):
    errors = checks.compare(case, 2, strategy, layout, dtype=dtype,
                            implementation=implementation, seed=seed, shard_len=shard_len,
                            batch=batch, lanes=True)
    assert max(errors.values()) < tolerance, errors

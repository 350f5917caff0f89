"""Tuned default configs of the Triton attention kernels, and an optional autotuner.

`forward_config`/`backward_config` look up a small table keyed by
(head dim bucket, dtype class, GPU generation). `autotune` times candidate
configs of one kernel call and caches the winner per problem key, so later
look-ups with that key return it.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable, Hashable, Sequence
from typing import Any, TypeVar

import jax

from pallas_kernels import runtime
from pallas_kernels.triton import tiles
from pallas_kernels.triton.attention_bwd import BackwardConfig
from pallas_kernels.triton.attention_fwd import ForwardConfig

Config = TypeVar("Config")

# (head-dim bucket, "16bit" | "fp32", generation) -> config. Generation "sm90" is Hopper;
# everything else (Ampere, Ada, interpret mode) takes "sm80". The sm90 16-bit rows for the
# forward (head dims 64, 128, 256) and the head-dim-128 backward are the winners of
# `python -m benchmarks.tune_triton_attention` on an H100 (2026-11-23, bf16, 16k tokens,
# 16 heads, seq 4096); the other rows are estimates. Causal masks take the same rows: with
# `tiles.exp2` the 128x64 tile also wins causal d128 (2026-11-25 sweep: s4096 0.734 ms
# against 0.760 for 128x128 with 8 warps and 3 stages, s16384 2.415 against 2.465).
# The sm90 16-bit head-dim-256 backward (also 192's, padded to 256): dK and dV in
# launches of their own, 64 x 64 tiles (2026-11-27 sweeps, b4 s4096 fwd+bwd): 16.9 ms dense
# and 7.0 causal against 34.3 and 17.9 for the previous row, whose one program
# holding both accumulators spills (the dense best, 15.7 ms, took 10.0 causal). The sm80
# row stays the light estimate it was: an A100 has 164 KiB of shared memory, and no
# sm80 GPU has run these kernels at head dim 256.
_FORWARD = {
    (64, "16bit", "sm90"): ForwardConfig(block_q=64, block_kv=128, num_warps=4, num_stages=3),
    (128, "16bit", "sm90"): ForwardConfig(block_q=128, block_kv=64, num_warps=4, num_stages=2),
    (256, "16bit", "sm90"): ForwardConfig(block_q=128, block_kv=64, num_warps=8, num_stages=2),
    (64, "16bit", "sm80"): ForwardConfig(block_q=128, block_kv=64, num_warps=4, num_stages=3),
    (128, "16bit", "sm80"): ForwardConfig(block_q=128, block_kv=64, num_warps=8, num_stages=2),
    (256, "16bit", "sm80"): ForwardConfig(block_q=64, block_kv=32, num_warps=8, num_stages=2),
    (64, "fp32", "sm90"): ForwardConfig(block_q=64, block_kv=32, num_warps=4, num_stages=2),
    (128, "fp32", "sm90"): ForwardConfig(block_q=64, block_kv=32, num_warps=4, num_stages=2),
    (256, "fp32", "sm90"): ForwardConfig(block_q=32, block_kv=32, num_warps=4, num_stages=1),
    (64, "fp32", "sm80"): ForwardConfig(block_q=64, block_kv=32, num_warps=4, num_stages=2),
    (128, "fp32", "sm80"): ForwardConfig(block_q=64, block_kv=32, num_warps=4, num_stages=1),
    (256, "fp32", "sm80"): ForwardConfig(block_q=32, block_kv=32, num_warps=4, num_stages=1),
}
_BACKWARD = {
    (64, "16bit", "sm90"): BackwardConfig(32, 128, 128, 32, num_warps=4, num_stages=3),
    (128, "16bit", "sm90"): BackwardConfig(64, 64, 64, 64, num_warps=4, num_stages=2),
    (256, "16bit", "sm90"): BackwardConfig(64, 64, 64, 64, num_warps=4, num_stages=2,
                                           split_dkdv=True),
    (64, "16bit", "sm80"): BackwardConfig(32, 128, 128, 32, num_warps=4, num_stages=2),
    (128, "16bit", "sm80"): BackwardConfig(32, 64, 64, 32, num_warps=4, num_stages=2),
    (256, "16bit", "sm80"): BackwardConfig(16, 64, 64, 16, num_warps=8, num_stages=1),
    (64, "fp32", "sm90"): BackwardConfig(32, 64, 64, 32, num_warps=4, num_stages=1),
    (128, "fp32", "sm90"): BackwardConfig(16, 64, 64, 16, num_warps=4, num_stages=1),
    (256, "fp32", "sm90"): BackwardConfig(16, 32, 32, 16, num_warps=4, num_stages=1),
    (64, "fp32", "sm80"): BackwardConfig(32, 64, 64, 32, num_warps=4, num_stages=1),
    (128, "fp32", "sm80"): BackwardConfig(16, 32, 32, 16, num_warps=4, num_stages=1),
    (256, "fp32", "sm80"): BackwardConfig(16, 32, 32, 16, num_warps=4, num_stages=1),
}

# Calls with fewer query rows than this (decoding steps; GQA packs each group's query heads
# into rows) take tiles of `tiles.MIN_TILE` rows: a 128-row tile would compute rows of
# padding only. The measured row (H100, bf16, d128, 2026-11-27 sweep of block_q 16/128,
# block_kv 64/128, 2-4 stages over four decoding shapes): 16 x 128 tiles, 2 stages, 0.98-1.32x
# cuDNN, where the 128 x 64 row gave 0.62-0.85x. Other rows keep their block_kv.
SHORT_Q_LEN = 128
_SHORT_Q_FORWARD = {
    (128, "16bit", "sm90"): ForwardConfig(block_q=16, block_kv=128, num_warps=4, num_stages=2),
}

_TUNED: dict[Hashable, Any] = {}


def _table_key(head_dim: int, dtype: Any) -> tuple[int, str, str]:
    bucket = 64 if head_dim <= 64 else 128 if head_dim <= 128 else 256
    dtype_class = "fp32" if jax.numpy.dtype(dtype).itemsize == 4 else "16bit"
    generation = "sm90" if runtime.gpu_compute_capability() == (9, 0) else "sm80"
    return bucket, dtype_class, generation


def problem_key(shapes: Sequence[tuple[int, ...]], dtype: Any, block_size: Any) -> Hashable:
    """The autotune cache key of a call: q/k/v shapes, dtype and mask block size."""
    return tuple(map(tuple, shapes)), str(jax.numpy.dtype(dtype)), block_size


def forward_config(head_dim: int, dtype: Any, tune_key: Hashable = None,
                   q_len: int | None = None) -> ForwardConfig:
    """The autotuned config for ``tune_key`` if any, else the table default (for calls
    of fewer than `SHORT_Q_LEN` query rows, the short-query one)."""
    tuned = _TUNED.get(("forward", tune_key))
    if tuned is not None:
        return tuned
    key = _table_key(head_dim, dtype)
    if q_len is not None and q_len < SHORT_Q_LEN:
        return _SHORT_Q_FORWARD.get(key, dataclasses.replace(_FORWARD[key],
                                                             block_q=tiles.MIN_TILE))
    return _FORWARD[key]


def backward_config(head_dim: int, dtype: Any, tune_key: Hashable = None) -> BackwardConfig:
    """The autotuned config for ``tune_key`` if any, else the table default."""
    tuned = _TUNED.get(("backward", tune_key))
    return tuned if tuned is not None else _BACKWARD[_table_key(head_dim, dtype)]


def set_tuned(kind: str, tune_key: Hashable, config: Any) -> None:
    """Makes ``config`` the one `forward_config`/`backward_config` return for ``tune_key``."""
    if kind not in ("forward", "backward"):
        raise ValueError(f"kind must be 'forward' or 'backward', got {kind!r}")
    _TUNED[(kind, tune_key)] = config


def autotune(kind: str, tune_key: Hashable, candidates: Sequence[Config],
             build: Callable[[Config], Callable[[], Any]], *, samples: int = 5) -> Config:
    """Times each candidate, caches the fastest under ``tune_key`` and returns it.

    ``kind`` is "forward" or "backward". ``build(config)`` returns a function
    of no arguments running the kernel with that config (returning JAX
    arrays); it is called once to compile, then ``samples`` times. Candidates
    that fail to build or compile (too much shared memory, ...) are skipped.
    """
    best, best_seconds = None, float("inf")
    for config in candidates:
        try:
            fn = build(config)
            jax.block_until_ready(fn())
        except Exception:  # noqa: BLE001 - a config the compiler rejects is not a winner
            continue
        times = []
        for _ in range(samples):
            start = time.perf_counter()
            jax.block_until_ready(fn())
            times.append(time.perf_counter() - start)
        if statistics.median(times) < best_seconds:
            best, best_seconds = config, statistics.median(times)
    if best is None:
        raise RuntimeError(f"no candidate {kind} config ran for {tune_key!r}")
    set_tuned(kind, tune_key, best)
    return best

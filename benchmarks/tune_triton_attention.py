"""Sweeps the Triton attention kernels' tile configs on this GPU and prints the timings.

For filling the tuned-defaults table in `pallas_kernels/triton/configs.py`:

    python -m benchmarks.tune_triton_attention --head-dims 64 128 256 --seq 4096

Each candidate is installed with `configs.set_tuned` for the exact problem key,
compiled, and timed with `benchmarks.timing.bench` (forward candidates on the
forward, backward candidates on forward + backward with the default forward).
"""

from __future__ import annotations

import argparse
import itertools

import jax
import jax.numpy as jnp
import jaxlib

import omni_jax
from benchmarks.timing import bench, tflops
from omni_jax.backends import triton as triton_backend
from pallas_kernels.triton import configs
from pallas_kernels.triton.attention_bwd import BackwardConfig
from pallas_kernels.triton.attention_fwd import ForwardConfig


def forward_candidates(head_dim: int) -> list[ForwardConfig]:
    if head_dim > 128:
        grid = itertools.product((64, 128), (32, 64), (8,), (1, 2))
    else:
        grid = itertools.product((64, 128), (64, 128), (4, 8), (2, 3))
    return [ForwardConfig(q, kv, num_warps=w, num_stages=s) for q, kv, w, s in grid]


def backward_candidates(head_dim: int) -> list[BackwardConfig]:
    """Above head dim 128: kv tiles of 64 rows, dQ tiles apart, and dK and dV in one
    launch or in launches of their own (`split_dkdv`)."""
    if head_dim > 128:
        grid = itertools.product((32, 64), ((64, 32), (64, 64)), (4, 8), (1, 2), (False, True))
        return [BackwardConfig(q_dkv, 64, q_dq, kv_dq, num_warps=w, num_stages=st,
                               split_dkdv=split)
                for q_dkv, (q_dq, kv_dq), w, st, split in grid]
    grid = itertools.product((32, 64), (64, 128), (4, 8), (2, 3))
    return [BackwardConfig(s, big, big, s, num_warps=w, num_stages=st) for s, big, w, st in grid]


def _sweep(kind, candidates, tune_key, fn, args, flops, samples):
    rows = []
    for config in candidates:
        configs.set_tuned(kind, tune_key, config)
        try:
            # A new function object per candidate: jit would otherwise reuse the first trace.
            ms = bench(jax.jit(lambda *a: fn(*a)), [args], warmup=2, samples=samples, inner=3)
        except Exception as error:  # noqa: BLE001 - a config the compiler rejects
            print(f"  {kind:8s} {config}: failed ({type(error).__name__})", flush=True)
            continue
        rows.append((ms, config))
        print(f"  {kind:8s} {config}: {ms:.3f} ms {tflops(flops, ms):.0f} TFLOP/s", flush=True)
    if not rows:
        return None
    best = min(rows, key=lambda row: row[0])
    configs.set_tuned(kind, tune_key, best[1])
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--head-dims", type=int, nargs="+", default=[128])
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--tokens", type=int, default=16384, help="batch x seq")
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--causal", choices=("yes", "no", "both"), default="both")
    parser.add_argument("--backward", action="store_true", help="also sweep backward configs")
    parser.add_argument("--samples", type=int, default=5)
    args = parser.parse_args()
    print(f"jax {jax.__version__}, jaxlib {jaxlib.__version__}, {jax.devices()[0].device_kind}")
    batch = max(1, args.tokens // args.seq)
    causal_values = {"yes": (True,), "no": (False,), "both": (False, True)}[args.causal]
    summary = []
    for head_dim, causal in itertools.product(args.head_dims, causal_values):
        shape = (batch, args.seq, args.heads, head_dim)
        keys = jax.random.split(jax.random.key(0), 3)
        q, k, v = (jax.random.normal(key, shape, jnp.bfloat16) for key in keys)
        block = triton_backend._default_block_size(args.seq, args.seq)
        tune_key = configs.problem_key((shape, shape, shape), q.dtype, tuple(block))
        flops = 4 * batch * args.heads * args.seq ** 2 * head_dim / (2 if causal else 1)

        def forward(q, k, v, causal=causal):
            return omni_jax.attention(q, k, v, is_causal=causal, implementation="triton")

        def forward_backward(q, k, v, forward=forward):
            out, vjp = jax.vjp(forward, q, k, v)
            return vjp(out)

        print(f"== {shape} causal={causal}", flush=True)
        best = _sweep("forward", forward_candidates(head_dim), tune_key, forward, (q, k, v),
                      flops, args.samples)
        summary.append((head_dim, causal, "forward", best))
        if args.backward:
            best = _sweep("backward", backward_candidates(head_dim), tune_key, forward_backward,
                          (q, k, v), 3.5 * flops, args.samples)
            summary.append((head_dim, causal, "forward+backward", best))
    print("\nbest configs:")
    for head_dim, causal, kind, best in summary:
        if best is not None:
            print(f"  d{head_dim} causal={causal} {kind}: {best[0]:.3f} ms {best[1]}")


if __name__ == "__main__":
    main()

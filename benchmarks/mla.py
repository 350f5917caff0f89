"""Sparse MLA prefill: the SM90 FFI kernel, with and without the score output, beside the
portable JAX path.

    python -m benchmarks mla            # H100 problem: s_q=4096 h_q=128 topk=2048 s_kv=32768
    python -m benchmarks mla --tiny     # CPU smoke test (portable path only)

TFLOP/s counts 2 * s_q * h_q * topk * (d_qk + d_v) for every row (the score output adds
memory traffic, not flops). ``ratio`` = portable path ms / this row's ms.
"""

from __future__ import annotations

import argparse
import math

import jax
import jax.numpy as jnp
import jaxlib

from benchmarks.timing import add_run_arguments, bench_interleaved, tflops, timing_options
from omni_jax import sparse_mla_prefill
from omni_jax.sparse_mla import kernel, kernel_platform_reason
from omni_jax.sparse_mla.validation import ProblemShape

BASELINE = "portable"
IMPLS = ("ffi", "ffi+scores", "portable", "portable+scores")
TINY = dict(s_q=4, h_q=64, topk=128, s_kv=256, d_qk=576, d_v=512)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--s-q", type=int, default=4096)
    parser.add_argument("--h-q", type=int, default=128)
    parser.add_argument("--topk", type=int, default=2048)
    parser.add_argument("--s-kv", type=int, default=32768)
    parser.add_argument("--d-qk", type=int, default=576)
    parser.add_argument("--d-v", type=int, default=512)
    add_run_arguments(parser, impls=IMPLS, tiny=f"tiny sizes: {TINY}", samples=10, inner=3)


def _inputs(sizes: dict, seed: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Random bf16 q/kv and uniformly random indices, about 1% of them invalid (-1)."""
    k_q, k_kv, k_idx, k_bad = jax.random.split(jax.random.key(seed), 4)
    q = jax.random.normal(k_q, (sizes["s_q"], sizes["h_q"], sizes["d_qk"]), jnp.bfloat16)
    kv = jax.random.normal(k_kv, (sizes["s_kv"], 1, sizes["d_qk"]), jnp.bfloat16)
    shape = (sizes["s_q"], 1, sizes["topk"])
    indices = jax.random.randint(k_idx, shape, 0, sizes["s_kv"], jnp.int32)
    indices = jnp.where(jax.random.uniform(k_bad, shape) < 0.01, -1, indices)
    return q, kv, indices


def _skip_reason(impl: str, sizes: dict) -> str | None:
    """Why an implementation cannot run here, or None."""
    if not impl.startswith("ffi"):
        return None
    shape = ProblemShape(s_q=sizes["s_q"], h_q=sizes["h_q"], d_qk=sizes["d_qk"],
                         s_kv=sizes["s_kv"], h_kv=1, topk=sizes["topk"], d_v=sizes["d_v"])
    reason = kernel.unsupported_reason(shape, jnp.bfloat16) or kernel_platform_reason()
    return None if reason is None else f"skipped: {reason}"


def run(args: argparse.Namespace) -> list[dict]:
    sizes = dict(TINY) if args.tiny else dict(
        s_q=args.s_q, h_q=args.h_q, topk=args.topk, s_kv=args.s_kv, d_qk=args.d_qk,
        d_v=args.d_v)
    print(f"jax {jax.__version__}, jaxlib {jaxlib.__version__}, device {jax.devices()[0]}")
    case = ("s_q={s_q} h_q={h_q} topk={topk} s_kv={s_kv} d_qk={d_qk} d_v={d_v}"
            .format(**sizes))
    flops = 2 * sizes["s_q"] * sizes["h_q"] * sizes["topk"] * (sizes["d_qk"] + sizes["d_v"])
    sm_scale = sizes["d_qk"] ** -0.5
    arg_sets = [_inputs(sizes, seed) for seed in range(2)]
    timing = timing_options(args)

    notes, fns = {}, {}
    for impl in args.impls:
        reason = _skip_reason(impl, sizes)
        if reason is not None:
            notes[impl] = reason
            continue
        fns[impl] = jax.jit(lambda q, kv, i, impl=impl: sparse_mla_prefill(
            q, kv, i, sm_scale=sm_scale, d_v=sizes["d_v"],
            return_scores=impl.endswith("+scores"),
            implementation="ffi" if impl.startswith("ffi") else "xla"))
        notes[impl] = "SM90 CUDA kernel (XLA FFI)" if impl.startswith("ffi") else "blockwise JAX"
        if impl.endswith("+scores"):
            notes[impl] += ", fp32 scores [s_q, h_q, topk] written"
    # Timed together, samples alternating: clock drift hits every implementation alike.
    power: dict[str, str] = {}
    timed = bench_interleaved(fns, arg_sets, **timing, telemetry=power)

    rows = []
    for impl in args.impls:
        ms = timed.get(impl, math.nan)  # NaN: skipped, the note says why
        if isinstance(ms, Exception):
            notes[impl], ms = f"failed: {type(ms).__name__}: {ms!s:.160}", math.nan
        rows.append(dict(case=case, impl=impl, ms=ms, tflops=tflops(flops, ms), ratio=None,
                         note=notes[impl]))

    ms_of = {row["impl"]: row["ms"] for row in rows}
    baseline = ms_of.get(BASELINE, math.nan)
    for row in rows:
        if not math.isnan(baseline) and not math.isnan(row["ms"]):
            row["ratio"] = baseline / row["ms"]
        without_scores = ms_of.get(row["impl"].removesuffix("+scores"), math.nan)
        if row["impl"].endswith("+scores") and not math.isnan(row["ms"] / without_scores):
            row["note"] += f" ({row['ms'] / without_scores - 1:+.1%} time vs without)"
        row["note"] = "; ".join(filter(None, [row["note"], power.get(row["impl"])]))
    return rows


if __name__ == "__main__":
    import sys

    from benchmarks.__main__ import main

    raise SystemExit(main(["mla", *sys.argv[1:]]))

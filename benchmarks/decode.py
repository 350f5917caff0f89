"""Decoding steps: few queries per sequence over a long KV cache, beside cuDNN and XLA.

    python -m benchmarks decode                 # H100: GQA (32 query, 8 kv heads), d128
    python -m benchmarks decode --tiny          # CPU smoke test

Each shape is ``batch,q_len,kv_len,q_heads,kv_heads,head_dim``; omni_jax gets the Flax
layer's cache mask (`omni_jax.flax.decode_mask`, a full cache: query t sees slots up to
kv_len - q_len + t), the jax.nn rows no mask (the same keys at q_len 1). ``ratio`` =
cuDNN ms / this row's ms (XLA's where cuDNN is absent); the note gives the K/V bytes
read per second, the bound of a decoding step.
"""

from __future__ import annotations

import argparse
import math

import jax
import jax.numpy as jnp

import omni_jax
from benchmarks.timing import add_run_arguments, bench_interleaved, tflops, timing_options
from omni_jax.flax.cache import decode_mask

SHAPES = ("8,1,8192,32,8,128", "32,1,4096,32,8,128", "8,1,32768,32,8,128",
          "1,1,131072,32,8,128", "8,16,8192,32,8,128", "8,1,8192,64,64,128")
TINY_SHAPES = ("2,1,256,8,2,32", "1,4,300,4,1,32")
IMPLS = ("omni", "omni_mosaic", "omni_triton", "omni_xla", "cudnn", "jax_xla")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES),
                        help="batch,q_len,kv_len,q_heads,kv_heads,head_dim per shape")
    add_run_arguments(parser, impls=IMPLS, tiny=f"tiny shapes: {' '.join(TINY_SHAPES)}")


def _shape(text: str) -> tuple[int, ...]:
    sizes = tuple(int(x) for x in text.split(","))
    if len(sizes) != 6 or sizes[3] % sizes[4]:
        raise ValueError(f"a shape is batch,q_len,kv_len,q_heads,kv_heads,head_dim with "
                         f"q_heads a multiple of kv_heads; got {text!r}")
    return sizes


def _function(impl: str, mask):
    if impl in ("cudnn", "jax_xla"):
        which = "cudnn" if impl == "cudnn" else "xla"
        return jax.jit(lambda q, k, v: jax.nn.dot_product_attention(q, k, v,
                                                                    implementation=which))
    backend = None if impl == "omni" else impl.removeprefix("omni_")
    return jax.jit(lambda q, k, v: omni_jax.attention(q, k, v, mask=mask,
                                                      implementation=backend))


def run(args: argparse.Namespace) -> list[dict]:
    shapes = [_shape(s) for s in (TINY_SHAPES if args.tiny else args.shapes)]
    timing = timing_options(args)
    rows = []
    for batch, q_len, kv_len, heads, kv_heads, dim in shapes:
        keys = jax.random.split(jax.random.key(0), 3)
        q = jax.random.normal(keys[0], (batch, q_len, heads, dim), jnp.bfloat16)
        k, v = (jax.random.normal(key, (batch, kv_len, kv_heads, dim), jnp.bfloat16)
                for key in keys[1:])
        mask = decode_mask(jnp.full((batch,), kv_len - q_len, jnp.int32), q_len, kv_len)
        case = f"b={batch} q={q_len} kv={kv_len} h={heads}/{kv_heads} d={dim}"
        power: dict[str, str] = {}
        timed = bench_interleaved({impl: _function(impl, mask) for impl in args.impls},
                                  [(q, k, v)], **timing, telemetry=power)
        kv_bytes = 2 * batch * kv_len * kv_heads * dim * 2
        flops = 4 * batch * heads * q_len * kv_len * dim
        shape_rows = []
        for impl in args.impls:
            ms, note = timed[impl], ""
            if isinstance(ms, Exception):
                ms, note = math.nan, f"failed: {type(ms).__name__}: {ms!s:.160}"
            else:
                note = f"{kv_bytes / ms / 1e6:.0f} GB/s of K/V"
            shape_rows.append(dict(case=case, impl=impl, ms=ms, tflops=tflops(flops, ms),
                                   ratio=None, note="; ".join(filter(None, [note,
                                                                            power.get(impl)]))))
        ms_of = {row["impl"]: row["ms"] for row in shape_rows}
        baseline = ms_of.get("cudnn", math.nan)
        if math.isnan(baseline):
            baseline = ms_of.get("jax_xla", math.nan)
        for row in shape_rows:
            if not math.isnan(baseline) and not math.isnan(row["ms"]):
                row["ratio"] = baseline / row["ms"]
        rows += shape_rows
    return rows


if __name__ == "__main__":
    import sys

    from benchmarks.__main__ import main

    raise SystemExit(main(["decode", *sys.argv[1:]]))

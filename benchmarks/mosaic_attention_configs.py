"""Sweeps the Mosaic-GPU attention forward configs (block_kv, num_stages, schedule, q-blocks
per CTA, Q in registers, consumers) on one shape.

For tuning `pallas_kernels.mosaic.attention_fwd_sm90._CONFIGS` on an H100:

    python -m benchmarks.mosaic_attention_configs --seq 4096 --head-dim 128 --causal

Rows: every config of the sweep
("mosaic[block_kv=..,stages=..,pipelined,q_blocks=..,q_regs=..,consumers=..]"), the current
default config ("mosaic"), cuDNN (the baseline) and the XLA backend.
Peers that cannot run here are skipped with a note; on a CPU only the XLA row
runs (use tiny sizes there).
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import math

import jax
import jax.numpy as jnp
import numpy as np

import omni_jax
from benchmarks.timing import bench_interleaved, tflops
from omni_jax.masks import BlockGrid, BlockMask, Causal
from omni_jax.masks.construct import structured_tile_flags
from pallas_kernels import runtime
from pallas_kernels.block_sparse import kernel_mask
from pallas_kernels.mosaic import attention_fwd_sm90 as fwd

BASELINE = "cudnn"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--tokens", type=int, default=16384, help="batch x seq")
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16"))
    parser.add_argument("--causal", action="store_true")
    parser.add_argument("--block-kv", type=int, nargs="+", default=[64, 128, 192])
    parser.add_argument("--stages", type=int, nargs="+", default=[2, 3, 4])
    parser.add_argument("--schedules", nargs="+", default=["pipelined", "serial"],
                        choices=("pipelined", "serial"),
                        help="consumer schedules (ForwardConfig.pipelined True / False)")
    parser.add_argument("--q-blocks-per-cta", type=int, nargs="+", default=[1],
                        help="ForwardConfig.q_blocks_per_cta values")
    parser.add_argument("--q-in-registers", type=int, nargs="+", choices=(0, 1), default=None,
                        help="ForwardConfig.q_in_registers values (default: the head dim's "
                             "default config's)")
    parser.add_argument("--num-consumers", type=int, nargs="+", choices=(2, 3), default=None,
                        help="ForwardConfig.num_consumers values (default: the default "
                             "config's; 3 runs dense masks only, pipelined, block_kv <= 128)")
    parser.add_argument("--samples", type=int, default=10)


def _mask(seq: int, block_kv: int, causal: bool) -> BlockMask:
    grid = BlockGrid(seq, seq, fwd.BLOCK_Q, block_kv)
    mod = Causal() if causal else None
    return BlockMask.from_tile_flags(structured_tile_flags(mod, grid), mask_mod=mod,
                                     q_len=seq, kv_len=seq, block_size=(fwd.BLOCK_Q, block_kv))


def _mosaic_fn(config: fwd.ForwardConfig, seq: int, head_dim: int, causal: bool):
    kmask, layout = kernel_mask(_mask(seq, config.block_kv, causal))

    @jax.jit
    def run(q, k, v):
        return fwd.attention_forward(q, k, v, kmask, layout, scale=1 / math.sqrt(head_dim),
                                     softcap=None, score_mod=None, has_partial=False,
                                     config=config)[0]

    return run


def run(args: argparse.Namespace) -> list[dict]:
    print(f"jax {jax.__version__}, jaxlib {jax.lib.__version__}, device {jax.devices()[0]}")
    batch = max(1, args.tokens // args.seq)
    shape = (batch, args.seq, args.heads, args.head_dim)
    dtype = jnp.dtype(args.dtype)
    rng = np.random.default_rng(0)
    arg_sets = [tuple(jnp.asarray(rng.standard_normal(shape), dtype) for _ in range(3))
                for _ in range(2)]
    flops = 4 * batch * args.heads * args.seq * args.seq * args.head_dim
    flops = flops / 2 if args.causal else flops
    case = (f"b{batch} s{args.seq} h{args.heads} d{args.head_dim} {args.dtype}"
            f"{' causal' if args.causal else ''}")
    fns = {
        BASELINE: jax.jit(lambda q, k, v: jax.nn.dot_product_attention(
            q, k, v, is_causal=args.causal, implementation="cudnn")),
        "xla": jax.jit(lambda q, k, v: omni_jax.attention(
            q, k, v, is_causal=args.causal, implementation="xla")),
    }
    mosaic_skipped = not runtime.can_run_mosaic_hopper() or runtime.interpret_requested()
    if not mosaic_skipped:
        default = fwd.forward_config(args.head_dim, dtype, args.causal)
        kmask, layout = kernel_mask(_mask(args.seq, default.block_kv, args.causal))
        if fwd.uniform_full_walks(kmask, layout, has_partial=False):  # dense, whole blocks
            default = fwd.forward_config(args.head_dim, dtype, args.causal, uniform_walks=True)
        fns["mosaic"] = _mosaic_fn(default, args.seq, args.head_dim, args.causal)
        q_in_registers = (args.q_in_registers if args.q_in_registers is not None
                          else [int(default.q_in_registers)])
        for block_kv, stages, schedule, per_cta, q_regs, consumers in itertools.product(
                args.block_kv, args.stages, args.schedules, args.q_blocks_per_cta,
                q_in_registers, args.num_consumers or [default.num_consumers]):
            config = dataclasses.replace(default, block_kv=block_kv, num_stages=stages,
                                         pipelined=schedule == "pipelined",
                                         q_blocks_per_cta=per_cta, q_in_registers=bool(q_regs),
                                         num_consumers=consumers)
            name = (f"mosaic[block_kv={block_kv},stages={stages},{schedule},q_blocks={per_cta},"
                    f"q_regs={q_regs},consumers={consumers}]")
            fns[name] = _mosaic_fn(config, args.seq, args.head_dim, args.causal)
    # Samples in turn, so that clock drift favours no config.
    timed: dict[str, float | None] = {}
    notes: dict[str, str] = {}
    for name, result in bench_interleaved(fns, arg_sets, samples=args.samples).items():
        if isinstance(result, Exception):  # reported as a skipped row
            timed[name], notes[name] = None, f"skipped: {type(result).__name__}: {result}"[:200]
        else:
            timed[name], notes[name] = result, ""
    if mosaic_skipped:
        timed["mosaic"], notes["mosaic"] = None, "skipped: needs an sm90 GPU (compiled)"

    base = timed.get(BASELINE)
    rows = []
    for name, ms in timed.items():
        rows.append({"case": case, "impl": name, "ms": ms if ms is not None else float("nan"),
                     "tflops": tflops(flops, ms) if ms else float("nan"),
                     "ratio": base / ms if base and ms else None, "note": notes[name]})
    for row in rows:
        ratio = "" if row["ratio"] is None else f"{row['ratio']:.2f}x"
        print(f"{row['case']:<40} {row['impl']:<34} {row['ms']:9.3f} ms "
              f"{row['tflops']:7.1f} TF/s {ratio:>7} {row['note']}")
    return rows


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    run(parser.parse_args())

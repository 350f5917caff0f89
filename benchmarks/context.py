"""Context parallelism: causal attention fwd+bwd over a sequence sharded across devices.

    python -m benchmarks context                       # every device; 32k tokens per device
    python -m benchmarks context --tiny                # CPU smoke test (2 host devices)

Each shape is ``tokens_per_device,heads,kv_heads,head_dim`` (batch 1, bfloat16, causal);
the sequence is ``devices x tokens_per_device``. Rows: ``ring`` / ``allgather`` (our
strategies, zigzag layout, ``--implementation`` kernels), ``single`` (one device on
``tokens_per_device`` tokens: the rate to keep), and ``fa3_ring`` (`flash_attn3_jax`'s
``flash_mha`` on sequence-sharded inputs) when that package is importable. Every
sharded row's out and gradients are first checked against the single-device call on
the whole sequence: ours must match; a peer that does not gets a row saying so, untimed.
``tflops`` is per device: useful FLOPs (the causal half, x3.5 for
fwd+bwd) over devices over time; ``ratio`` = per-device TFLOP/s / single's.
"""

from __future__ import annotations

import argparse
import importlib.util
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import omni_jax
from benchmarks.timing import add_run_arguments, bench_interleaved, tflops, timing_options
from omni_jax.context_parallel import unzigzag, zigzag

SHAPES = ("32768,16,16,128", "32768,16,4,128")
TINY_SHAPES = ("64,2,2,16", "64,4,1,16")
IMPLS = ("ring", "allgather", "single", "fa3_ring")
AXIS = "seq"
# bfloat16 results of one device against several differ by roundings only; a wrong block
# is off by O(1).
TOLERANCE = 2e-2


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES),
                        help="tokens_per_device,heads,kv_heads,head_dim per shape")
    parser.add_argument("--devices", type=int, default=None,
                        help="devices along the sequence (default: all)")
    parser.add_argument("--implementation", default=None, choices=("xla", "triton", "mosaic"),
                        help="omni_jax kernels (default: the best available)")
    parser.add_argument("--nondeterministic", action="store_true",
                        help="omni_jax.attention(..., deterministic=False): atomic dQ sums")
    add_run_arguments(parser, impls=IMPLS, tiny=f"tiny shapes: {' '.join(TINY_SHAPES)}",
                      warmup=2, samples=5, inner=3)


def _shape(text: str) -> tuple[int, int, int, int]:
    sizes = tuple(int(x) for x in text.split(","))
    if len(sizes) != 4 or sizes[1] % sizes[2]:
        raise ValueError(f"a shape is tokens_per_device,heads,kv_heads,head_dim with heads a "
                         f"multiple of kv_heads; got {text!r}")
    return sizes


def _grad_fn(attention):
    """q, k, v, dout -> (out, dq, dk, dv) of ``attention(q, k, v)``."""

    def run(q, k, v, dout):
        out, pullback = jax.vjp(attention, q, k, v)
        return (out, *pullback(dout))

    return run


def _omni(implementation: str | None, deterministic: bool, **context):
    return lambda q, k, v: omni_jax.attention(q, k, v, is_causal=True,
                                              implementation=implementation,
                                              deterministic=deterministic, **context)


def _sharded(mesh, strategy: str, implementation: str | None, deterministic: bool):
    """Our strategy on zigzag shards: takes and returns global arrays in zigzag order."""
    seq = P(None, AXIS)
    attention = _omni(implementation, deterministic, context_axis=AXIS,
                      context_strategy=strategy, context_layout="zigzag")
    return jax.jit(jax.shard_map(_grad_fn(attention), mesh=mesh, in_specs=(seq,) * 4,
                                 out_specs=(seq,) * 4))


def _fa3_ring(mesh):
    from flash_attn3_jax import flash_mha

    sharding = NamedSharding(mesh, P(None, AXIS))
    return jax.jit(_grad_fn(lambda q, k, v: flash_mha(q, k, v, is_causal=True)),
                   in_shardings=sharding, out_shardings=sharding)


def _relative_error(got, want) -> float:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    if not np.all(np.isfinite(got)):
        return math.inf
    return float(np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30))


def _mismatch(results, reference) -> str | None:
    """How ``results`` differ from the single-device call on the whole sequence, or None."""
    for label, got, want in zip(("out", "dq", "dk", "dv"), results, reference, strict=True):
        error = _relative_error(got, want)
        if not error < TOLERANCE:
            return f"{label} differs from the single-device call by {error:.2e} (relative)"
    return None


def run(args: argparse.Namespace) -> list[dict]:
    shapes = [_shape(s) for s in (TINY_SHAPES if args.tiny else args.shapes)]
    timing = timing_options(args)
    deterministic = not args.nondeterministic
    num_devices = args.devices or len(jax.devices())
    if not 1 <= num_devices <= len(jax.devices()):
        raise ValueError(f"--devices must be between 1 and {len(jax.devices())}, got "
                         f"{num_devices}")
    mesh = jax.make_mesh((num_devices,), (AXIS,), axis_types=(jax.sharding.AxisType.Auto,),
                         devices=jax.devices()[:num_devices])
    impls = [i for i in args.impls
             if i != "fa3_ring" or importlib.util.find_spec("flash_attn3_jax") is not None]
    rows = []
    for tokens, heads, kv_heads, dim in shapes:
        length = num_devices * tokens
        keys = jax.random.split(jax.random.key(0), 4)
        q, dout = (jax.random.normal(key, (1, length, heads, dim), jnp.bfloat16)
                   for key in keys[::3])
        k, v = (jax.random.normal(key, (1, length, kv_heads, dim), jnp.bfloat16)
                for key in keys[1:3])
        reference = jax.jit(_grad_fn(_omni(args.implementation, deterministic)))(q, k, v, dout)
        shard = tuple(x[:, :tokens] for x in (q, k, v, dout))
        case = f"{num_devices}x{tokens} tokens h={heads}/{kv_heads} d={dim}"
        functions, arguments, wrong = {}, {}, {}
        for impl in impls:
            if impl == "single":
                functions[impl] = jax.jit(_grad_fn(_omni(args.implementation, deterministic)))
                arguments[impl] = shard
                continue
            # Inputs placed on the devices first: timing must not include scattering them.
            sequence = NamedSharding(mesh, P(None, AXIS))
            if impl == "fa3_ring":
                functions[impl] = _fa3_ring(mesh)
                arguments[impl] = jax.device_put((q, k, v, dout), sequence)
                results = functions[impl](*arguments[impl])
            else:
                functions[impl] = _sharded(mesh, impl, args.implementation, deterministic)
                arguments[impl] = jax.device_put(
                    tuple(zigzag(x, num_devices) for x in (q, k, v, dout)), sequence)
                results = [unzigzag(x, num_devices)
                           for x in functions[impl](*arguments[impl])]
            mismatch = _mismatch(results, reference)
            if mismatch is not None:
                if impl != "fa3_ring":  # ours must be right; a peer's error is its row
                    raise AssertionError(f"{impl} {case}: {mismatch}")
                wrong[impl] = ValueError(f"wrong result, not timed: {mismatch}")
        timed = {}
        for impl in impls:  # each with its own arguments, timed one after the other
            if impl in wrong:
                timed[impl] = wrong[impl]
                continue
            timed |= bench_interleaved({impl: functions[impl]}, [arguments[impl]], **timing)
        rows += _rows(case, timed, tokens, heads, dim, num_devices)
    return rows


def _rows(case: str, timed: dict, tokens: int, heads: int, dim: int,
          num_devices: int) -> list[dict]:
    def per_device_flops(impl: str) -> float:
        length = tokens if impl == "single" else num_devices * tokens
        devices = 1 if impl == "single" else num_devices
        return 3.5 * 4 * heads * length * length * dim / 2 / devices

    rows = []
    for impl, ms in timed.items():
        note = ""
        if isinstance(ms, Exception):
            ms, note = math.nan, f"failed: {type(ms).__name__}: {ms!s:.160}"
        rows.append(dict(case=case, impl=impl, ms=ms, tflops=tflops(per_device_flops(impl), ms),
                         ratio=None, note=note))
    single = next((row["tflops"] for row in rows if row["impl"] == "single"), None)
    for row in rows:
        if single and row["tflops"] is not None and not math.isnan(row["tflops"]):
            row["ratio"] = row["tflops"] / single
    return rows


if __name__ == "__main__":
    import sys

    from benchmarks.__main__ import main

    raise SystemExit(main(["context", *sys.argv[1:]]))

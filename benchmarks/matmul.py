"""GEMM: omni_jax.matmul's kernels beside cuBLAS (``jnp.dot``) and JAX's Hopper Pallas GEMM.

    python -m benchmarks matmul                      # H100: bf16 sweep, fused epilogue, fp8
    python -m benchmarks matmul --suites sweep --autotune   # tune each shape first
    python -m benchmarks matmul --impls mosaic mosaic/pingpong=1/stages=3   # A/B of configs
    python -m benchmarks matmul --tiny               # CPU smoke test (XLA rows only)

Suites (the rows of a case are timed on the same inputs, their samples interleaved):
  sweep     bf16 (M, N, K) from 1024 to 16384 per side, plain ``C = A @ B``; a
            geometric-mean row per implementation closes the sweep.
  epilogue  ``gelu(A @ B + bias)``: the baseline is ``jnp.dot`` followed by XLA's
            fused bias + gelu; ours fuse it into the GEMM's epilogue.
  fp8       e4m3 operands (A as (M, K), B as (N, K)) with per-tensor scales, bf16
            out; the baseline is XLA's scaled fp8 dot (cuBLASLt).

``mosaic/FIELD=N/...`` is the Mosaic kernel with those fields of its default
`MatmulConfig` changed (the ring the deepest that fits, unless ``stages`` is given), so
several configs are timed side by side in one run.

``ratio`` = the baseline's ms / this row's ms (above 1: faster than the baseline).
TFLOP/s counts 2 * M * N * K.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
import jaxlib

import omni_jax
from benchmarks.timing import add_impls_argument, add_sustain_argument, bench_interleaved, tflops
from omni_jax.matmul import implementations
from pallas_kernels.matmul_common import GemmProblem, problem_of

BASELINE = "cublas"
OURS = ("mosaic", "triton", "xla")
PEERS = ("cublas", "jax_hopper_mgpu")
SUITES = ("sweep", "epilogue", "fp8")
# "mosaic/FIELD=N/...": the Mosaic kernel with those MatmulConfig fields changed.
FORCED_MOSAIC_PREFIX = "mosaic/"

SWEEP = (
    (1024, 1024, 1024), (2048, 2048, 2048), (4096, 4096, 4096), (8192, 8192, 8192),
    (16384, 16384, 16384), (4096, 8192, 4096), (8192, 4096, 8192), (2048, 8192, 2048),
    (8192, 2048, 8192), (16384, 4096, 14336), (16384, 14336, 4096), (16384, 8192, 1024),
    (1024, 16384, 4096), (4096, 16384, 2048),
)
# The fused epilogue saves XLA's separate pass over the M x N output: much at small K
# (MLP projections), about 1% at 8192^3.
EPILOGUE = ((4096, 8192, 4096), (8192, 8192, 8192), (16384, 14336, 4096), (16384, 8192, 1024),
            (8192, 8192, 2048))
FP8 = ((8192, 8192, 8192), (4096, 8192, 4096))
TINY = {"sweep": ((64, 64, 64), (96, 128, 64)), "epilogue": ((64, 128, 64),),
        "fp8": ((64, 64, 64),)}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--suites", nargs="+", choices=SUITES, default=list(SUITES))
    add_impls_argument(parser, default=("mosaic", "triton", *PEERS), check=_impl_name,
                       choices=f"{', '.join(OURS + PEERS)}, or {FORCED_MOSAIC_PREFIX}FIELD=N/...")
    parser.add_argument("--shapes", nargs="+", metavar="M,N,K",
                        help="replace every suite's shapes by these")
    parser.add_argument("--autotune", action="store_true",
                        help="autotune the Mosaic kernel on each shape before timing it")
    parser.add_argument("--tiny", action="store_true",
                        help="tiny shapes for a CPU smoke test")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--samples", type=int, default=10)
    parser.add_argument("--inner", type=int, default=5)
    add_sustain_argument(parser)


def _impl_name(impl: str) -> str:
    """Checks an ``--impls`` name: one of `OURS` / `PEERS`, or a forced Mosaic config."""
    if impl in OURS + PEERS:
        return impl
    if impl.startswith(FORCED_MOSAIC_PREFIX):
        _forced_fields(impl)
        return impl
    raise ValueError(
        f"unknown implementation {impl!r}; choose from {OURS + PEERS} or "
        f"{FORCED_MOSAIC_PREFIX}FIELD=N/...")


def _forced_fields(impl: str) -> dict[str, int]:
    """The MatmulConfig fields ``mosaic/FIELD=N/...`` forces (of the Mosaic kernel of this
    machine's architecture: Hopper's, or Blackwell's)."""
    config_type = implementations.module("mosaic").MatmulConfig
    names = {field.name for field in dataclasses.fields(config_type)}
    fields = {}
    for item in impl[len(FORCED_MOSAIC_PREFIX):].split("/"):
        name, _, value = item.partition("=")
        if name not in names or not value.isdigit():
            raise ValueError(
                f"{impl!r}: expected FIELD=N with FIELD one of {sorted(names)}, got {item!r}")
        fields[name] = int(value)
    return fields


# ---------------------------------------------------------------------------------- inputs


def _inputs(suite: str, m: int, n: int, k: int, seed: int) -> tuple:
    """(a, b, bias, a_scale, b_scale); fp8 keeps B as (N, K), its K-major layout."""
    ka, kb, kc = jax.random.split(jax.random.key(seed), 3)
    if suite == "fp8":
        a = jax.random.normal(ka, (m, k), jnp.float32).astype(jnp.float8_e4m3fn)
        b = jax.random.normal(kb, (n, k), jnp.float32).astype(jnp.float8_e4m3fn)
        return a, b, None, jnp.float32(0.5), jnp.float32(2.0)
    a = jax.random.normal(ka, (m, k), jnp.bfloat16)
    b = jax.random.normal(kb, (k, n), jnp.bfloat16)
    bias = jax.random.normal(kc, (n,), jnp.bfloat16) if suite == "epilogue" else None
    return a, b, bias, None, None


# ------------------------------------------------------------------------- implementations


def _ours(suite: str, impl: str):
    if suite == "fp8":
        return lambda a, b, bias, sa, sb: omni_jax.matmul(
            a, b, transpose_b=True, a_scale=sa, b_scale=sb, out_dtype=jnp.bfloat16,
            implementation=impl)
    activation = "gelu_tanh" if suite == "epilogue" else None
    return lambda a, b, bias, sa, sb: omni_jax.matmul(
        a, b, bias=bias, activation=activation, implementation=impl)


def _cublas(suite: str):
    if suite == "fp8":
        def scaled_fp8_dot(a, b, bias, sa, sb):
            out = jnp.dot(a, b.T, preferred_element_type=jnp.float32) * (sa * sb)
            return out.astype(jnp.bfloat16)
        return scaled_fp8_dot
    if suite == "epilogue":
        return lambda a, b, bias, sa, sb: jax.nn.gelu(jnp.dot(a, b) + bias)
    return lambda a, b, bias, sa, sb: jnp.dot(a, b)


@functools.cache
def _jax_hopper_module():
    from jax.experimental.pallas.ops.gpu import hopper_matmul_mgpu

    return hopper_matmul_mgpu


def _jax_hopper(m: int, n: int, k: int):
    """JAX's own Hopper Pallas GEMM (128x128 warpgroup tiles, as its docs tune it)."""
    module = _jax_hopper_module()
    fields = {f.name for f in dataclasses.fields(module.TuningConfig)}
    config = dict(tile_m=128, tile_n=128, tile_k=64, max_concurrent_steps=4,
                  grid_minor_dim=module.MatmulDimension.N, grid_tile_width=8)
    config = module.TuningConfig(**{key: v for key, v in config.items() if key in fields})
    if hasattr(module, "matmul"):
        return lambda a, b, bias, sa, sb: module.matmul(a, b, None, config)
    return lambda a, b, bias, sa, sb: module.matmul_kernel(a, b, config)


def _skip_reason(impl: str, suite: str, m: int, n: int, k: int) -> str | None:
    if impl == BASELINE:
        return None
    if impl == "jax_hopper_mgpu":
        if suite != "sweep":
            return "skipped: no fused epilogue / fp8 in JAX's Hopper GEMM"
        if jax.default_backend() != "gpu" or implementations.unavailable_reason("mosaic"):
            return "skipped: needs an sm90 GPU"
        try:
            _jax_hopper_module()
        except ImportError as error:
            return f"skipped: not importable ({error})"
        if m % 256 or n % 128 or k % 64:
            return "skipped: needs M % 256, N % 128, K % 64 == 0"
        return None
    backend = impl.split("/")[0]  # a forced config's backend: "mosaic"
    reason = implementations.unavailable_reason(backend)
    if reason is None and backend != "xla" and jax.default_backend() != "gpu":
        reason = "runs interpreted here: too slow to time"
    if reason is None:
        reason = implementations.why_not(backend, _problem(suite, m, n, k))
    return None if reason is None else f"skipped: {reason}"


def _problem(suite: str, m: int, n: int, k: int) -> GemmProblem:
    """The GemmProblem `_ours` hands the implementations for a case (what they serve)."""
    a, b, bias, sa, _ = jax.eval_shape(lambda: _inputs(suite, m, n, k, 0))
    scale = jax.ShapeDtypeStruct((n,), jnp.float32) if sa is not None else None
    return problem_of(a, b, scale, bias, transpose_a=False, transpose_b=suite == "fp8",
                      activation="gelu_tanh" if suite == "epilogue" else None,
                      out_dtype=jnp.bfloat16)


def _function(impl: str, suite: str, m: int, n: int, k: int):
    if impl == BASELINE:
        return _cublas(suite)
    if impl == "jax_hopper_mgpu":
        return _jax_hopper(m, n, k)
    return _ours(suite, impl)


def _note(impl: str, suite: str) -> str:
    if impl == BASELINE:
        where = "cuBLAS" if jax.default_backend() == "gpu" else f"XLA on {jax.default_backend()}"
        return {"sweep": f"jnp.dot ({where})",
                "epilogue": f"jnp.dot ({where}) + XLA fused bias+gelu",
                "fp8": f"XLA scaled fp8 dot ({where})"}[suite]
    if impl == "jax_hopper_mgpu":
        return "jax.experimental.pallas.ops.gpu.hopper_matmul_mgpu, 128x128 tiles"
    return {"sweep": "omni_jax.matmul", "epilogue": "omni_jax.matmul, fused bias+gelu",
            "fp8": "omni_jax.matmul, fp8 e4m3 with scales"}[suite]


def _mosaic_kwargs(suite: str, args_set: tuple) -> tuple:
    """(a, b, scale, bias, kwargs) as `omni_jax.matmul` hands them to the Mosaic kernel."""
    a, b, bias, sa, sb = args_set
    kwargs = dict(transpose_b=True) if suite == "fp8" else {}
    if suite == "epilogue":
        kwargs["activation"] = "gelu_tanh"
    scale = None
    if suite == "fp8":
        scale = jnp.broadcast_to(sa * sb, (b.shape[0],)).astype(jnp.float32)
        kwargs["out_dtype"] = jnp.bfloat16
    bias = None if bias is None else bias.astype(jnp.float32)
    return a, b, scale, bias, kwargs


def _forced(impl: str, suite: str, args_set: tuple) -> tuple[Callable, str]:
    """The Mosaic kernel with the default config's fields changed as ``impl`` says, and
    the config for the row's note."""
    kernel = implementations.module("mosaic")
    a, b, scale, bias, kwargs = _mosaic_kwargs(suite, args_set)
    out_dtype = jnp.dtype(kwargs.get("out_dtype") or a.dtype)
    p = problem_of(a, b, scale, bias, transpose_a=False,
                   transpose_b=kwargs.get("transpose_b", False),
                   activation=kwargs.get("activation"), out_dtype=out_dtype)
    vectors = int(p.has_scale) + int(p.has_bias)
    config = kernel.default_config(p.m, p.n, p.k, p.in_dtype, p.out_dtype, vectors=vectors)
    changes = {name: type(getattr(config, name))(value)
               for name, value in _forced_fields(impl).items()}
    config = dataclasses.replace(config, **changes)
    while ("stages" not in changes and config.stages > 2
           and config.smem_bytes(p.in_dtype, p.out_dtype, vectors) > kernel.SMEM_BYTES):
        config = dataclasses.replace(config, stages=config.stages - 1)  # deepest that fits

    def forced(a, b, bias, sa, sb):
        a, b, scale, bias, kwargs = _mosaic_kwargs(suite, (a, b, bias, sa, sb))
        return kernel.matmul(a, b, scale, bias, config=config, **kwargs)

    return forced, f"config {config}"


def _autotune(suite: str, args_set: tuple) -> str:
    """Tunes the Mosaic kernel on these inputs; returns the winner for the row's note."""
    from benchmarks.matmul_autotune import autotune

    a, b, scale, bias, kwargs = _mosaic_kwargs(suite, args_set)
    best, _ = autotune(a, b, scale, bias, **kwargs)
    return f"tuned {best}"


# ------------------------------------------------------------------------------------ run


def _shapes(args: argparse.Namespace, suite: str) -> tuple:
    if args.tiny:
        return TINY[suite]
    if args.shapes:
        return tuple(tuple(int(x) for x in shape.split(",")) for shape in args.shapes)
    return {"sweep": SWEEP, "epilogue": EPILOGUE, "fp8": FP8}[suite]


def run(args: argparse.Namespace) -> list[dict]:
    print(f"jax {jax.__version__}, jaxlib {jaxlib.__version__}, device {jax.devices()[0]}")
    timing = dict(warmup=args.warmup, samples=args.samples, inner=args.inner)
    if args.tiny:
        timing = dict(warmup=1, samples=2, inner=1)
    timing["sustain_s"] = args.sustain
    impls = list(args.impls)
    if args.tiny and "xla" not in impls:
        impls.append("xla")
    impls = [BASELINE, *(impl for impl in impls if impl != BASELINE)]

    rows = []
    for suite in args.suites:
        suite_rows = []
        for m, n, k in _shapes(args, suite):
            case = f"{suite} {m}x{n}x{k}"
            arg_sets = [_inputs(suite, m, n, k, seed) for seed in range(2)]
            notes, fns, failures = {}, {}, {}
            for impl in impls:
                reason = _skip_reason(impl, suite, m, n, k)
                if reason is not None:
                    notes[impl] = reason
                    continue
                notes[impl] = _note(impl.split("/")[0], suite)
                if args.autotune and impl == "mosaic":
                    notes[impl] += f"; {_autotune(suite, arg_sets[0])}"
                try:
                    if impl.startswith(FORCED_MOSAIC_PREFIX):
                        function, config = _forced(impl, suite, arg_sets[0])
                        notes[impl] += f"; {config}"
                    else:
                        function = _function(impl, suite, m, n, k)
                    fns[impl] = jax.jit(function)
                except Exception as error:  # noqa: BLE001 - a failing peer is a row, not a crash
                    failures[impl] = error
            # Timed together, samples alternating: clock drift hits every implementation alike.
            power: dict[str, str] = {}
            timed = {**failures, **bench_interleaved(fns, arg_sets, **timing, telemetry=power)}
            case_rows = []
            for impl in impls:
                ms = timed.get(impl, math.nan)  # NaN: skipped, the note says why
                if isinstance(ms, Exception):
                    notes[impl], ms = f"failed: {ms!s:.200}", math.nan
                note = "; ".join(filter(None, [notes[impl], power.get(impl)]))
                case_rows.append(dict(case=case, impl=impl, ms=ms, tflops=tflops(2 * m * n * k, ms),
                                      ratio=None, note=note))
            baseline = next(r["ms"] for r in case_rows if r["impl"] == BASELINE)
            for row in case_rows:
                if not math.isnan(row["ms"]):
                    row["ratio"] = baseline / row["ms"]
            del arg_sets
            suite_rows += case_rows
        rows += suite_rows + _geomean_rows(suite, suite_rows, impls)
    return rows


def _geomean_rows(suite: str, rows: list[dict], impls: list[str]) -> list[dict]:
    """Geometric means of TFLOP/s and ratio per implementation over a suite's cases."""
    out = []
    for impl in impls:
        timed = [r for r in rows if r["impl"] == impl and r["ratio"] is not None]
        if not timed:
            continue
        ratios = [r["ratio"] for r in timed]
        out.append(dict(
            case=f"{suite} geomean ({len(timed)} shapes)", impl=impl, ms=math.nan,
            tflops=math.exp(sum(math.log(r["tflops"]) for r in timed) / len(timed)),
            ratio=math.exp(sum(math.log(x) for x in ratios) / len(ratios)),
            note=f"min ratio {min(ratios):.3f}",
        ))
    return out


if __name__ == "__main__":
    import sys

    from benchmarks.__main__ import main

    raise SystemExit(main(["matmul", *sys.argv[1:]]))

"""One attention case of `benchmarks.attention`, run once per implementation, for ncu.

Compiles and warms each implementation outside the profiled range, then calls
each once between cudaProfilerStart/Stop, so ``ncu --profile-from-start off``
records exactly those kernels. JAX's preallocation is turned off: ncu saves and
restores all allocated GPU memory around each kernel replay, which with most of
the GPU preallocated takes minutes per kernel.

    ncu --profile-from-start off --section SpeedOfLight --section WarpStateStats \\
        python scripts/ncu_attention.py --impls omni_mosaic,fa4 \\
        --case "dense b4 s4096 h16 d128 fwd+bwd"
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import os

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax  # noqa: E402 - after the allocator setting

from benchmarks import attention  # noqa: E402


def _cudart() -> ctypes.CDLL:
    """The CUDA runtime that JAX's plugin loaded (for the profiler range calls)."""
    for name in ("libcudart.so.13", "libcudart.so.12", ctypes.util.find_library("cudart")):
        if name:
            try:
                return ctypes.CDLL(name)
            except OSError:
                continue
    raise OSError("no CUDA runtime library found for cudaProfilerStart")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--case", required=True, help="a case name as the benchmark prints it")
    parser.add_argument("--impls", required=True, help="comma-separated implementation names")
    args = parser.parse_args()
    cases = {case.name: case for case in attention.default_cases(tiny=False)
             + attention.length_sweep([1024, 2048, 4096, 8192, 16384, 32768], (64, 128, 256))}
    if args.case not in cases:
        parser.error(f"unknown case {args.case!r}; e.g. {sorted(cases)[:3]}")
    case = cases[args.case]
    inputs = attention._inputs(case, 1)[0]
    fns = {impl: attention._timed_fn(attention.builder(impl)(case), case.backward)
           for impl in args.impls.split(",")}
    for fn in fns.values():
        jax.block_until_ready(fn(*inputs))
    cudart = _cudart()
    cudart.cudaProfilerStart()
    for fn in fns.values():
        jax.block_until_ready(fn(*inputs))
    cudart.cudaProfilerStop()


if __name__ == "__main__":
    main()

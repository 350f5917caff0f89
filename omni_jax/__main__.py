"""Command line: ``python -m omni_jax info``.

info   versions, the devices, each attention backend and matmul implementation with
       whether it runs here (and why not), and the state of the sparse MLA FFI library;
       builds and compiles nothing
"""

from __future__ import annotations

import argparse
import importlib.metadata
import platform
import sys

import jax

from omni_jax import backends
from omni_jax.ffi import __main__ as ffi_cli
from omni_jax.matmul import implementations as matmul_implementations
from pallas_kernels import runtime

_PACKAGES = ("omni-jax", "jax", "jaxlib", "flax", "numpy", "triton", "nvidia-cutlass")


def _version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def _availability(reason: str | None) -> str:
    return "runs here" if reason is None else f"unavailable: {reason}"


def report() -> list[str]:
    """The lines `python -m omni_jax info` prints."""
    lines = [f"python:           {platform.python_version()} ({sys.executable})"]
    lines += [f"{package + ':':<18}{_version(package)}" for package in _PACKAGES]
    devices = jax.devices()
    capability = runtime.gpu_compute_capability()
    lines.append(f"devices:          {len(devices)} x {devices[0].device_kind} "
                 f"({jax.default_backend()})")
    lines.append("compute capab.:   " + ("none (no CUDA GPU)" if capability is None
                                         else f"{capability[0]}.{capability[1]}"))
    lines.append(f"interpret mode:   {'on' if runtime.interpret_requested() else 'off'} "
                 f"(${runtime.INTERPRET_ENV_VAR})")
    order = backends.preference_order()
    lines.append(f"attention:        default order here {', '.join(order)}")
    for name in ("mosaic", "triton", "xla"):
        reason = backends.get_backend(name).unavailable_reason()
        lines.append(f"  {name:<16}{_availability(reason)}")
    lines.append("matmul:")
    for name in ("mosaic", "triton", "xla"):
        reason = matmul_implementations.unavailable_reason(name)
        lines.append(f"  {name:<16}{_availability(reason)}")
    ffi_lines, _ = ffi_cli.status()
    lines.append("sparse MLA FFI library (python -m omni_jax.ffi info):")
    lines += [f"  {line}" for line in ffi_lines]
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m omni_jax", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("info", help="versions, devices, backends and the FFI library")
    parser.parse_args(argv)
    print("\n".join(report()))
    return 0


if __name__ == "__main__":
    sys.exit(main())

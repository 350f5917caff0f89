"""Command line: ``python -m omni_jax.ffi {build,info}``.

build            compile the library into the build cache (what first use would do)
build --prebuilt compile into omni_jax/ffi/prebuilt/ so that a wheel ships it
build --out P    compile to an explicit .so path, or into directory P
                 (load it with $OMNI_JAX_FFI_LIBRARY=<the .so>)
info             report, without building anything, the toolchain, the library this process
                 would load and whether it loads, and whether this device can run it; exits 0
                 only when the kernels can run here now
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from omni_jax.ffi import build, library

T = TypeVar("T")


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _build(args: argparse.Namespace) -> int:
    wanted = args.arch or build.DEFAULT_ARCHS
    archs = tuple(arch for arch in build.DEFAULT_ARCHS if arch in wanted)  # canonical order
    build.find_toolchain()  # before naming an output, fail early when nvcc/CUTLASS is missing
    if args.out:
        output = Path(args.out)
        if output.suffix != ".so":
            output = output / build.LIBRARY_NAME
    elif args.prebuilt:
        output = library.PREBUILT_PATH
    else:
        output = library.cached_library_path(archs)
    print(f"compiling {len(build.source_files())} source(s) for {', '.join(archs)} -> {output}")
    build.build_library(output, archs=archs, jobs=args.jobs)
    print(f"built {output}")
    return 0


def _attempt(action: Callable[[], T]) -> tuple[T | None, str | None]:
    """``action()`` and None, or None and why it failed."""
    try:
        return action(), None
    except (build.BuildError, OSError) as error:
        return None, str(error)


def _library_origin(path: Path) -> str:
    if os.environ.get(library.LIBRARY_ENV_VAR):
        return f"${library.LIBRARY_ENV_VAR}"
    return "prebuilt" if path == library.PREBUILT_PATH else "build cache"


def status() -> tuple[list[str], bool]:
    """The toolchain, the library this process would load and whether it loads, and
    whether this device can run it, as report lines (building nothing); and whether the
    kernels can run here now."""
    lines = [f"sources:          {build.SOURCE_DIR} ({len(build.source_files())} .cu)"]
    nvcc, why = _attempt(build.find_nvcc)
    lines.append(f"nvcc:             {nvcc if why is None else 'not found: ' + why}")
    cutlass, why = _attempt(build.find_cutlass_include)
    lines.append(f"CUTLASS include:  {cutlass if why is None else 'not found: ' + why}")
    path, why = _attempt(library.find_library)
    if why is None and path is None:
        why = (f"not built yet: run `python -m omni_jax.ffi build` (first use compiles it "
               f"unless {library.AUTOBUILD_ENV_VAR}=0)")
    if why is None:
        lines.append(f"library:          {path} ({_library_origin(path)})")
        _, why = _attempt(lambda: library.open_library(path))
        lines.append(f"loads:            {'yes' if why is None else 'no: ' + why}")
    else:
        lines.append(f"library:          none: {why}")
    device_why = library.device_reason()
    lines.append(f"device:           {'sm90 GPU' if device_why is None else device_why}")
    usable = why is None and device_why is None
    lines.append(f"kernels usable:   {'yes' if usable else 'no'}")
    return lines, usable


def _info(_: argparse.Namespace) -> int:
    lines, usable = status()
    print("\n".join(lines))
    return 0 if usable else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m omni_jax.ffi", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    build_parser = commands.add_parser("build", help="compile the FFI library")
    where = build_parser.add_mutually_exclusive_group()
    where.add_argument("--out", help="output .so path or directory")
    where.add_argument("--prebuilt", action="store_true", help="build into the package (wheel)")
    build_parser.add_argument("--arch", action="append", choices=build.DEFAULT_ARCHS,
                              help="target architecture (repeatable; default: all)")
    build_parser.add_argument("--jobs", type=_positive_int, default=None,
                              help="parallel nvcc processes")
    build_parser.set_defaults(run=_build)
    commands.add_parser("info", help="report toolchain, library and device status (builds "
                        "nothing)").set_defaults(run=_info)
    args = parser.parse_args(argv)
    try:
        return args.run(args)
    except (build.BuildError, OSError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

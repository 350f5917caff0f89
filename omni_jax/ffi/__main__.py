"""Command line: ``python -m omni_jax.ffi {build,info}``.

build            compile the library into the build cache (what first use would do)
build --prebuilt compile into omni_jax/ffi/prebuilt/ so that a wheel ships it
build --out P    compile to an explicit .so path, or into directory P
                 (load it with $OMNI_JAX_FFI_LIBRARY=<the .so>)
info             print the toolchain found and whether the library loads here
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from omni_jax.ffi import build, library


def _build(args: argparse.Namespace) -> int:
    archs = tuple(args.arch) if args.arch else build.DEFAULT_ARCHS
    if args.out:
        output = Path(args.out)
        if output.suffix != ".so":
            output = output / build.LIBRARY_NAME
    elif args.prebuilt:
        output = library.PREBUILT_PATH
    else:
        output = library.cached_library_path()
    print(f"compiling {len(build.source_files())} source(s) for {', '.join(archs)} -> {output}")
    build.build_library(output, archs=archs, jobs=args.jobs)
    print(f"built {output}")
    return 0


def _info(_: argparse.Namespace) -> int:
    print(f"sources:          {build.SOURCE_DIR} ({len(build.source_files())} .cu)")
    print(f"nvcc:             {build.find_nvcc()}")
    print(f"CUTLASS include:  {build.find_cutlass_include()}")
    print(f"prebuilt library: {library.PREBUILT_PATH} (exists: {library.PREBUILT_PATH.is_file()})")
    result = library.load()
    print(f"loaded:           {result.path if result.loaded else result.reason}")
    return 0 if result.loaded else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m omni_jax.ffi", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    build_parser = commands.add_parser("build", help="compile the FFI library")
    where = build_parser.add_mutually_exclusive_group()
    where.add_argument("--out", help="output .so path or directory")
    where.add_argument("--prebuilt", action="store_true", help="build into the package (wheel)")
    build_parser.add_argument("--arch", action="append", help="sm_90a / sm_100a (repeatable)")
    build_parser.add_argument("--jobs", type=int, default=None, help="parallel nvcc processes")
    build_parser.set_defaults(run=_build)
    commands.add_parser("info", help="report toolchain and load status").set_defaults(run=_info)
    args = parser.parse_args(argv)
    try:
        return args.run(args)
    except build.BuildError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

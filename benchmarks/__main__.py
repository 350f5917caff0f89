"""One command for every benchmark.

    python -m benchmarks attention [args]    # one benchmark; --help lists its args
    python -m benchmarks matmul [args]
    python -m benchmarks mla [args]
    python -m benchmarks decode [args]
    python -m benchmarks paged [args]        # paged KV-cache attention
    python -m benchmarks context [args]      # context parallelism over the devices
    python -m benchmarks all [--attention-args "..."]   # every available benchmark
    python -m benchmarks gpu-suite [out_dir]   # GPU tests + all benchmarks (scripts/gpu_suite.sh)

Each benchmark module ``benchmarks/<name>.py`` provides ``add_arguments(parser)``
and ``run(args) -> rows``; this command prints the environment and a table,
and writes ``<name>.csv``, ``<name>.json``, ``<name>.png`` and a markdown
block for benchmarks/RESULTS.md (appended to ``RESULTS-block.md``) into
``--out-dir``. Modules are imported only when asked for, so a missing one
is reported as not available instead of breaking the others.
"""

from __future__ import annotations

import argparse
import importlib
import os
import shlex
import subprocess
import sys
import traceback
from pathlib import Path
from types import ModuleType

from benchmarks import report

BENCHMARKS = ("attention", "matmul", "mla", "decode", "paged", "context")
SUITE_SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "gpu_suite.sh"


def load(name: str) -> ModuleType | None:
    """``benchmarks.<name>``, or None when that module does not exist."""
    try:
        return importlib.import_module(f"benchmarks.{name}")
    except ModuleNotFoundError as error:
        if error.name == f"benchmarks.{name}":
            return None
        raise


def default_out_dir() -> Path:
    return Path(os.environ["OUT"]) / "benchmarks" if os.environ.get("OUT") else Path(
        "benchmark-results")


def add_common_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out-dir", type=Path, default=default_out_dir(),
                        help="where CSV/JSON/plots/markdown go (default: $OUT/benchmarks if "
                             "$OUT is set, else ./benchmark-results)")
    parser.add_argument("--no-plots", action="store_true", help="skip the matplotlib plots")
    parser.add_argument("--markdown", action="store_true",
                        help="print the table as markdown (it is also written to "
                             "RESULTS-block.md in --out-dir)")


def module_arguments(name: str, module: ModuleType, argv: list[str],
                     common: argparse.Namespace | None = None) -> argparse.Namespace:
    """Parses ``argv`` with the module's own arguments (plus the common ones)."""
    parser = argparse.ArgumentParser(prog=f"python -m benchmarks {name}",
                                     description=(module.__doc__ or "").strip(),
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     conflict_handler="resolve")
    add_common_arguments(parser)
    module.add_arguments(parser)
    args = parser.parse_args(argv)
    if common is not None:
        args.out_dir, args.no_plots, args.markdown = (common.out_dir, common.no_plots,
                                                      common.markdown)
    return args


def run_one(name: str, module: ModuleType, args: argparse.Namespace,
            meta: dict) -> list[report.Row]:
    """Runs one benchmark, prints its table and writes its files."""
    print(f"\n== {name} ==", flush=True)
    rows = report.check_rows(name, module.run(args))
    print(report.format_table(rows, markdown=args.markdown), flush=True)
    paths = report.save(name, rows, args.out_dir, meta, plots=not args.no_plots)
    print("wrote " + ", ".join(str(p) for p in paths))
    return rows


def write_markdown(results: dict[str, list[report.Row]], out_dir: Path, meta: dict,
                   command: str) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "RESULTS-block.md"
    with open(path, "a") as f:
        f.write(report.markdown_block(results, meta, command) + "\n")
    return path


def print_environment(meta: dict) -> None:
    print(f"jax {meta['jax']}, jaxlib {meta['jaxlib']}, Python {meta['python']}; "
          f"device: {meta['device']}; {meta['date']}", flush=True)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    commands = (*BENCHMARKS, "all", "gpu-suite")
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in commands:
        print(__doc__)
        if argv and argv[0] not in ("-h", "--help"):
            print(f"unknown command {argv[0]!r}; expected one of {', '.join(commands)}")
            return 2
        return 0
    command, rest = argv[0], argv[1:]
    command_line = "python -m benchmarks " + shlex.join(argv)
    if command == "gpu-suite":
        return subprocess.call(["bash", str(SUITE_SCRIPT), *rest])
    if command != "all":
        module = load(command)
        if module is None:
            print(f"benchmark {command!r}: not available (no module benchmarks/{command}.py)")
            return 2
        args = module_arguments(command, module, rest)
        meta = report.environment()
        print_environment(meta)
        rows = run_one(command, module, args, meta)
        print(f"markdown: {write_markdown({command: rows}, args.out_dir, meta, command_line)}")
        return 0

    parser = argparse.ArgumentParser(prog="python -m benchmarks all",
                                     description="every available benchmark, with defaults")
    add_common_arguments(parser)
    for name in BENCHMARKS:
        parser.add_argument(f"--{name}-args", default="", metavar="ARGS",
                            help=f"arguments for the {name} benchmark (one quoted string)")
    common = parser.parse_args(rest)
    meta = report.environment()
    print_environment(meta)
    results, problems = {}, []
    for name in BENCHMARKS:
        module = load(name)
        if module is None:
            print(f"\n== {name} ==\nnot available (no module benchmarks/{name}.py)")
            problems.append(f"{name}: not available")
            continue
        try:
            args = module_arguments(name, module, shlex.split(getattr(common, f"{name}_args")),
                                    common)
            results[name] = run_one(name, module, args, meta)
        except Exception as error:  # One broken benchmark must not hide the others' results.
            traceback.print_exc()
            problems.append(f"{name}: failed ({type(error).__name__}: {error})")
    if results:
        print(f"\nmarkdown: {write_markdown(results, common.out_dir, meta, command_line)}")
    for problem in problems:
        print(f"NOTE {problem}")
    return 1 if any("failed" in p for p in problems) or not results else 0


if __name__ == "__main__":
    sys.exit(main())

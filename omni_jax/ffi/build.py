"""Compiles the CUDA sources in the repository's ``ffi/`` directory into one shared library.

Inputs are all local: nvcc, the XLA FFI headers of the installed jaxlib
(``jax.ffi.include_dir()``) and the CUTLASS/CuTe headers of the pinned
``nvidia-cutlass`` wheel (``pip install omni-jax[ffi]``). Nothing is downloaded.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
import subprocess
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import jax

LIBRARY_NAME = "libomni_jax_ffi.so"
DEFAULT_ARCHS = ("sm_90a", "sm_100a")
NVCC_ENV_VAR = "OMNI_JAX_NVCC"
CUTLASS_ENV_VAR = "OMNI_JAX_CUTLASS_INCLUDE"
CACHE_ENV_VAR = "OMNI_JAX_CACHE_DIR"

SOURCE_DIR = Path(__file__).resolve().parents[2] / "ffi"

BASE_FLAGS = (
    "-std=c++17",
    "-O3",
    "--expt-relaxed-constexpr",
    "-Xcompiler=-fPIC",
)
WARNING_FLAGS = ("-Werror", "all-warnings", "-Xcompiler=-Wall,-Wextra,-Werror")


class BuildError(RuntimeError):
    """The FFI library cannot be built here (missing tool/headers, or nvcc failed)."""


def find_nvcc() -> str | None:
    """Path to nvcc: $OMNI_JAX_NVCC, then PATH, then $CUDA_HOME/bin."""
    explicit = os.environ.get(NVCC_ENV_VAR)
    if explicit:
        return explicit if Path(explicit).is_file() else None
    found = shutil.which("nvcc")
    if found:
        return found
    cuda_home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH") or "/usr/local/cuda"
    candidate = Path(cuda_home) / "bin" / "nvcc"
    return str(candidate) if candidate.is_file() else None


def find_cutlass_include() -> Path | None:
    """CUTLASS/CuTe include dir: $OMNI_JAX_CUTLASS_INCLUDE, else the nvidia-cutlass wheel's."""
    explicit = os.environ.get(CUTLASS_ENV_VAR)
    if explicit:
        return Path(explicit) if (Path(explicit) / "cute").is_dir() else None
    spec = importlib.util.find_spec("cutlass_library")
    if spec is None or not spec.submodule_search_locations:
        return None
    for location in spec.submodule_search_locations:
        include = Path(location) / "source" / "include"
        if (include / "cute").is_dir():
            return include
    return None


def source_files(source_dir: Path = SOURCE_DIR) -> list[Path]:
    """The .cu files, one per kernel family."""
    return sorted(source_dir.glob("*.cu"))


def source_archs(source: Path, archs: tuple[str, ...] = DEFAULT_ARCHS) -> tuple[str, ...]:
    """The archs of ``archs`` that one source is compiled for.

    A kernel family written for one architecture's instructions (wgmma on sm90, tcgen05 on
    sm100) says so in its file name: ``*_sm90.cu`` builds for sm_90a only, ``*_sm100.cu``
    for sm_100a only; any other .cu builds for every requested arch.
    """
    for suffix, arch in (("_sm90", "sm_90a"), ("_sm100", "sm_100a")):
        if source.stem.endswith(suffix):
            return tuple(a for a in archs if a == arch)
    return archs


def _header_files(source_dir: Path) -> list[Path]:
    return sorted((source_dir / "include").rglob("*.h")) + sorted(
        (source_dir / "include").rglob("*.cuh")
    )


def include_flags(source_dir: Path = SOURCE_DIR) -> list[str]:
    """Include flags: ours with -I; XLA FFI and CUTLASS as system headers (their warnings are
    not ours to fix, and warnings are errors in CI). Raises BuildError when one is missing."""
    cutlass = find_cutlass_include()
    if cutlass is None:
        raise BuildError(
            "CUTLASS headers not found: install the pinned wheel (pip install 'omni-jax[ffi]', "
            f"i.e. nvidia-cutlass) or set {CUTLASS_ENV_VAR} to a CUTLASS include directory"
        )
    return [
        f"-I{source_dir / 'include'}", "-isystem", jax.ffi.include_dir(), "-isystem", str(cutlass),
    ]


def arch_flags(archs: tuple[str, ...]) -> list[str]:
    """-gencode flags producing SASS for each ``sm_XXa`` arch."""
    flags = []
    for arch in archs:
        number = arch.removeprefix("sm_")
        flags.append(f"-gencode=arch=compute_{number},code={arch}")
    return flags


def _nvcc_version(nvcc: str) -> str:
    return subprocess.run([nvcc, "--version"], capture_output=True, text=True).stdout


def cache_key(nvcc: str, archs: tuple[str, ...], source_dir: Path = SOURCE_DIR) -> str:
    """Hash of everything the library depends on: sources, headers, flags, tool versions."""
    digest = hashlib.sha256()
    for path in source_files(source_dir) + _header_files(source_dir):
        digest.update(path.name.encode())
        digest.update(path.read_bytes())
    digest.update(" ".join(BASE_FLAGS + archs).encode())
    digest.update(_nvcc_version(nvcc).encode())
    digest.update(str(find_cutlass_include()).encode())
    digest.update(jax.ffi.include_dir().encode())
    return digest.hexdigest()[:16]


def cache_dir() -> Path:
    """Where built libraries live: $OMNI_JAX_CACHE_DIR, else ~/.cache/omni_jax/ffi."""
    root = os.environ.get(CACHE_ENV_VAR)
    if root:
        return Path(root) / "ffi"
    xdg = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(xdg) / "omni_jax" / "ffi"


def _run(command: list[str]) -> None:
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        raise BuildError(
            f"nvcc failed (exit {result.returncode}):\n{' '.join(command)}\n"
            f"{result.stdout}{result.stderr}"
        )


def compile_object(
    source: Path,
    output: Path,
    *,
    archs: tuple[str, ...] = DEFAULT_ARCHS,
    warnings_as_errors: bool = False,
    nvcc: str | None = None,
) -> None:
    """Compiles one .cu into an object file (warnings fail it when ``warnings_as_errors``)."""
    nvcc = nvcc or find_nvcc()
    if nvcc is None:
        raise BuildError(f"nvcc not found (set {NVCC_ENV_VAR}, PATH or CUDA_HOME)")
    command = [
        nvcc, *BASE_FLAGS, *(WARNING_FLAGS if warnings_as_errors else ()), *arch_flags(archs),
        *include_flags(source.parent), "-c", str(source), "-o", str(output),
    ]
    _run(command)


def link_library(
    objects: list[Path], output: Path, *, archs: tuple[str, ...] = DEFAULT_ARCHS,
    nvcc: str | None = None,
) -> None:
    """Links compiled objects into one shared library (CUDA runtime linked statically)."""
    nvcc = nvcc or find_nvcc()
    if nvcc is None:
        raise BuildError(f"nvcc not found (set {NVCC_ENV_VAR}, PATH or CUDA_HOME)")
    _run([nvcc, "-shared", *arch_flags(archs), *map(str, objects), "-o", str(output)])


def build_library(
    output: Path,
    *,
    archs: tuple[str, ...] = DEFAULT_ARCHS,
    source_dir: Path = SOURCE_DIR,
    jobs: int | None = None,
) -> Path:
    """Compiles every .cu in parallel and links them into ``output`` (written atomically)."""
    nvcc = find_nvcc()
    if nvcc is None:
        raise BuildError(f"nvcc not found (set {NVCC_ENV_VAR}, PATH or CUDA_HOME)")
    sources = [source for source in source_files(source_dir) if source_archs(source, archs)]
    if not sources:
        raise BuildError(f"no .cu sources for {', '.join(archs)} in {source_dir}")
    output.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=output.parent) as scratch:
        objects = [Path(scratch) / (source.stem + ".o") for source in sources]
        with ThreadPoolExecutor(max_workers=jobs or os.cpu_count() or 1) as pool:
            futures = [
                pool.submit(
                    compile_object, source, obj, archs=source_archs(source, archs), nvcc=nvcc
                )
                for source, obj in zip(sources, objects, strict=True)
            ]
            for future in futures:
                future.result()
        linked = Path(scratch) / LIBRARY_NAME
        link_library(objects, linked, archs=archs, nvcc=nvcc)
        os.replace(linked, output)
    return output

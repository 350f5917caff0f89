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


def find_nvcc() -> str:
    """Path to nvcc: $OMNI_JAX_NVCC when set, else nvcc on PATH, else bin/nvcc under the
    first of $CUDA_HOME, $CUDA_PATH that is set, else under /usr/local/cuda.

    Raises BuildError saying what was tried.
    """
    explicit = os.environ.get(NVCC_ENV_VAR)
    if explicit:
        if not Path(explicit).is_file():
            raise BuildError(f"{NVCC_ENV_VAR}={explicit} is not a file; set it to nvcc's path")
        if not os.access(explicit, os.X_OK):
            raise BuildError(f"{NVCC_ENV_VAR}={explicit} is not executable")
        return explicit
    found = shutil.which("nvcc")
    if found:
        return found
    home_var = next((name for name in ("CUDA_HOME", "CUDA_PATH") if os.environ.get(name)), None)
    candidate = Path(os.environ[home_var] if home_var else "/usr/local/cuda") / "bin" / "nvcc"
    if candidate.is_file() and os.access(candidate, os.X_OK):
        return str(candidate)
    where = f"${home_var}/bin ({candidate})" if home_var else str(candidate)
    raise BuildError(
        f"nvcc not found: not on PATH and no executable {where}; set {NVCC_ENV_VAR} to its "
        "path, or add the CUDA toolkit to PATH or CUDA_HOME"
    )


def _missing_headers(include: Path) -> list[str]:
    return [name + "/" for name in ("cute", "cutlass") if not (include / name).is_dir()]


def find_cutlass_include() -> Path:
    """CUTLASS/CuTe include dir: $OMNI_JAX_CUTLASS_INCLUDE when set, else the nvidia-cutlass
    wheel's. Raises BuildError saying what is missing."""
    explicit = os.environ.get(CUTLASS_ENV_VAR)
    if explicit:
        if not Path(explicit).is_dir():
            raise BuildError(f"{CUTLASS_ENV_VAR}={explicit} is not a directory")
        missing = _missing_headers(Path(explicit))
        if missing:
            raise BuildError(
                f"{CUTLASS_ENV_VAR}={explicit} has no {' or '.join(missing)} subdirectory; "
                "set it to a CUTLASS include directory (the one holding cute/ and cutlass/)"
            )
        return Path(explicit)
    spec = importlib.util.find_spec("cutlass_library")
    if spec is None or not spec.submodule_search_locations:
        raise BuildError(
            "CUTLASS headers not found: install the pinned wheel (pip install 'omni-jax[ffi]', "
            f"i.e. nvidia-cutlass) or set {CUTLASS_ENV_VAR} to a CUTLASS include directory"
        )
    includes = [Path(location) / "source" / "include"
                for location in spec.submodule_search_locations]
    for include in includes:
        if not _missing_headers(include):
            return include
    raise BuildError(
        f"the installed nvidia-cutlass wheel has no cute/ and cutlass/ headers under "
        f"{', '.join(map(str, includes))}; reinstall it (pip install 'omni-jax[ffi]') or set "
        f"{CUTLASS_ENV_VAR} to a CUTLASS include directory"
    )


def find_toolchain() -> tuple[str, Path]:
    """nvcc (checked to run) and the CUTLASS include dir; raises BuildError naming the first
    one missing."""
    nvcc = find_nvcc()
    version = _launch([nvcc, "--version"])
    if version.returncode != 0:
        detail = version.stderr.strip() or version.stdout.strip()
        raise BuildError(f"{nvcc} --version failed (exit {version.returncode}) {detail}".strip())
    return nvcc, find_cutlass_include()


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


def _launch(command: list[str]) -> subprocess.CompletedProcess[str]:
    """Runs nvcc; an OS error starting it (not executable, not a program) is a BuildError."""
    try:
        return subprocess.run(command, capture_output=True, text=True)
    except OSError as error:
        raise BuildError(f"cannot run nvcc {command[0]}: {error.strerror or error}") from error


def _nvcc_version(nvcc: str) -> str:
    return _launch([nvcc, "--version"]).stdout


def cache_key(nvcc: str, archs: tuple[str, ...], source_dir: Path = SOURCE_DIR) -> str:
    """The archs, then a hash of everything the library depends on (sources, headers, flags,
    tool versions): a build for other archs never takes another's place."""
    digest = hashlib.sha256()
    for path in source_files(source_dir) + _header_files(source_dir):
        digest.update(path.name.encode())
        digest.update(path.read_bytes())
    digest.update(" ".join(BASE_FLAGS + archs).encode())
    digest.update(_nvcc_version(nvcc).encode())
    digest.update(str(find_cutlass_include()).encode())
    digest.update(jax.ffi.include_dir().encode())
    return "-".join(archs) + "-" + digest.hexdigest()[:16]


def cache_dir() -> Path:
    """Where built libraries live: $OMNI_JAX_CACHE_DIR/ffi, else $XDG_CACHE_HOME/omni_jax/ffi,
    else ~/.cache/omni_jax/ffi."""
    root = os.environ.get(CACHE_ENV_VAR)
    if root:
        return Path(root) / "ffi"
    xdg = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(xdg) / "omni_jax" / "ffi"


def _run(command: list[str]) -> None:
    result = _launch(command)
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
    _run([nvcc, "-shared", *arch_flags(archs), *map(str, objects), "-o", str(output)])


def build_library(
    output: Path,
    *,
    archs: tuple[str, ...] = DEFAULT_ARCHS,
    source_dir: Path = SOURCE_DIR,
    jobs: int | None = None,
) -> Path:
    """Compiles every .cu in parallel and links them into ``output`` (written atomically).

    When nvcc fails, its whole output goes to `build_log_path` and the BuildError names
    that file with the first lines.
    """
    nvcc, _ = find_toolchain()
    sources = [source for source in source_files(source_dir) if source_archs(source, archs)]
    if not sources:
        raise BuildError(f"no .cu sources for {', '.join(archs)} in {source_dir}")
    output.parent.mkdir(parents=True, exist_ok=True)
    try:
        return _compile_and_link(output, sources, archs, nvcc, jobs)
    except BuildError as error:
        log = build_log_path(output)
        log.write_text(str(error))
        head = "\n".join(str(error).splitlines()[:3])
        raise BuildError(f"{head}\n... (the whole build log: {log})") from error


def build_log_path(output: Path) -> Path:
    """Where a failed build of ``output`` leaves nvcc's output."""
    return output.with_name(output.stem + ".build.log")


def _compile_and_link(output: Path, sources: list[Path], archs: tuple[str, ...], nvcc: str,
                      jobs: int | None) -> Path:
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

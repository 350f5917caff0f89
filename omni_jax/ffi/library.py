"""Finds, builds (on first use) and loads the FFI shared library, and registers its targets.

Lookup order for the library:
  1. ``$OMNI_JAX_FFI_LIBRARY`` (an explicit path);
  2. ``omni_jax/ffi/prebuilt/libomni_jax_ffi.so`` (shipped in a wheel built with
     ``python -m omni_jax.ffi build --prebuilt``);
  3. the build cache (``build.cache_dir()``), keyed by a hash of the sources, target archs,
     flags and tool versions: a build for the default archs, else one for just this GPU's
     arch; built there for the default archs with nvcc when missing, unless
     ``OMNI_JAX_FFI_AUTOBUILD=0``.
Loading and registration happen at most once per process.
"""

from __future__ import annotations

import ctypes
import os
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax

from omni_jax.ffi import build
from pallas_kernels import runtime

LIBRARY_ENV_VAR = "OMNI_JAX_FFI_LIBRARY"
AUTOBUILD_ENV_VAR = "OMNI_JAX_FFI_AUTOBUILD"
PREBUILT_PATH = Path(__file__).resolve().parent / "prebuilt" / build.LIBRARY_NAME
KERNEL_ARCH = "sm_90a"  # every target below is an sm90 kernel

# XLA custom-call target name -> exported handler symbol (XLA_FFI_DEFINE_HANDLER_SYMBOL).
TARGETS = {
    "omni_jax_sparse_mla_prefill_sm90": "OmniJaxSparseMlaPrefillSm90",
    "omni_jax_sparse_mla_prefill_scores_sm90": "OmniJaxSparseMlaPrefillScoresSm90",
}


@dataclass(frozen=True)
class LoadResult:
    """Outcome of loading the library: its path when loaded, else why not."""

    path: Path | None
    reason: str | None

    @property
    def loaded(self) -> bool:
        return self.path is not None


_lock = threading.Lock()
_result: LoadResult | None = None


def _autobuild_enabled() -> bool:
    return os.environ.get(AUTOBUILD_ENV_VAR, "1").strip().lower() not in ("0", "false", "no", "off")


def cached_library_path(archs: tuple[str, ...] = build.DEFAULT_ARCHS) -> Path:
    """Path of the library built for ``archs`` in the build cache, for the current sources and
    toolchain (raises BuildError when the toolchain is missing)."""
    return build.cache_dir() / build.cache_key(build.find_nvcc(), archs) / build.LIBRARY_NAME


def device_arch() -> str | None:
    """The ``sm_XXa`` arch of the default JAX device when it is a CUDA GPU, else None."""
    capability = runtime.gpu_compute_capability()
    if jax.default_backend() != "gpu" or capability is None:
        return None
    return f"sm_{capability[0]}{capability[1]}a"


def device_reason() -> str | None:
    """Why the default JAX device cannot run the library's kernels (all sm90), or None."""
    if jax.default_backend() != "gpu":
        return f"the default JAX backend is {jax.default_backend()!r}, not a CUDA GPU"
    if device_arch() != KERNEL_ARCH:
        capability = ".".join(map(str, runtime.gpu_compute_capability() or ()))
        return f"the kernels need an sm90 (Hopper) GPU, found compute capability {capability!r}"
    return None


def _cache_candidates() -> list[Path]:
    """Cached builds this device can use: the default archs', then its own arch's alone."""
    archs = [build.DEFAULT_ARCHS]
    arch = device_arch()
    if arch in build.DEFAULT_ARCHS and (arch,) != build.DEFAULT_ARCHS:
        archs.append((arch,))
    return [cached_library_path(a) for a in archs]


def find_library() -> Path | None:
    """The library to load, without building anything; None when the cache has no build.

    Raises BuildError when ``$OMNI_JAX_FFI_LIBRARY`` names no file, or when there is no
    prebuilt library and the cache cannot be looked up (no sources, no toolchain).
    """
    explicit = os.environ.get(LIBRARY_ENV_VAR)
    if explicit:
        if not Path(explicit).is_file():
            raise build.BuildError(f"{LIBRARY_ENV_VAR}={explicit} is not a file")
        return Path(explicit)
    if PREBUILT_PATH.is_file():
        return PREBUILT_PATH
    if not build.source_files():
        raise build.BuildError(
            f"no prebuilt library at {PREBUILT_PATH} and no CUDA sources at {build.SOURCE_DIR}"
        )
    try:
        candidates = _cache_candidates()
    except build.BuildError as error:
        raise build.BuildError(
            f"no ${LIBRARY_ENV_VAR}, no prebuilt library, and the build cache cannot be looked "
            f"up: {error}"
        ) from error
    return next((path for path in candidates if path.is_file()), None)


def _locate_or_build() -> Path:
    found = find_library()
    if found is not None:
        return found
    path = cached_library_path()
    if not _autobuild_enabled():
        raise build.BuildError(
            f"library not built yet ({path}) and {AUTOBUILD_ENV_VAR}=0; "
            "run `python -m omni_jax.ffi build`"
        )
    print(
        f"omni_jax: compiling the XLA FFI CUDA library into {path} "
        "(first use only; this takes a few minutes)...",
        file=sys.stderr,
        flush=True,
    )
    build.build_library(path)
    print("omni_jax: FFI CUDA library built.", file=sys.stderr, flush=True)
    return path


def open_library(path: Path) -> dict[str, Callable[..., Any]]:
    """Loads the library into the process; the handler of each XLA target, by target name.

    Raises OSError when it cannot be loaded, BuildError when a handler is missing.
    """
    library = ctypes.CDLL(str(path))
    missing = [symbol for symbol in TARGETS.values() if not hasattr(library, symbol)]
    if missing:
        raise build.BuildError(
            f"{path} does not export {', '.join(missing)} (built from other sources?)"
        )
    return {target: getattr(library, symbol) for target, symbol in TARGETS.items()}


def _register(path: Path) -> None:
    for target, handler in open_library(path).items():
        jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(handler), platform="CUDA")


def load() -> LoadResult:
    """Loads and registers the library once; never raises (failures land in ``reason``)."""
    global _result
    with _lock:
        if _result is None:
            try:
                path = _locate_or_build()
                _register(path)
                _result = LoadResult(path=path, reason=None)
            except (build.BuildError, OSError) as error:
                _result = LoadResult(path=None, reason=f"FFI library unavailable: {error}")
        return _result

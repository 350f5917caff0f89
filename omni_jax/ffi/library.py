"""Finds, builds (on first use) and loads the FFI shared library, and registers its targets.

Lookup order for the library:
  1. ``$OMNI_JAX_FFI_LIBRARY`` (an explicit path);
  2. ``omni_jax/ffi/prebuilt/libomni_jax_ffi.so`` (shipped in a wheel built with
     ``python -m omni_jax.ffi build --prebuilt``);
  3. the build cache (``$OMNI_JAX_CACHE_DIR`` or ``~/.cache/omni_jax``), keyed by a hash
     of the sources, flags and tool versions; built there with nvcc when missing,
     unless ``OMNI_JAX_FFI_AUTOBUILD=0``.
Loading and registration happen at most once per process.
"""

from __future__ import annotations

import ctypes
import os
import sys
import threading
from dataclasses import dataclass
from pathlib import Path

import jax

from omni_jax.ffi import build

LIBRARY_ENV_VAR = "OMNI_JAX_FFI_LIBRARY"
AUTOBUILD_ENV_VAR = "OMNI_JAX_FFI_AUTOBUILD"
PREBUILT_PATH = Path(__file__).resolve().parent / "prebuilt" / build.LIBRARY_NAME

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


def cached_library_path() -> Path:
    """Path of the library in the build cache for the current sources and toolchain."""
    nvcc = build.find_nvcc()
    if nvcc is None:
        raise build.BuildError(f"nvcc not found (set {build.NVCC_ENV_VAR}, PATH or CUDA_HOME)")
    return build.cache_dir() / build.cache_key(nvcc, build.DEFAULT_ARCHS) / build.LIBRARY_NAME


def _locate_or_build() -> Path:
    explicit = os.environ.get(LIBRARY_ENV_VAR)
    if explicit:
        if not Path(explicit).is_file():
            raise build.BuildError(f"{LIBRARY_ENV_VAR}={explicit} does not exist")
        return Path(explicit)
    if PREBUILT_PATH.is_file():
        return PREBUILT_PATH
    if not build.source_files():
        raise build.BuildError(
            f"no prebuilt library at {PREBUILT_PATH} and no CUDA sources at {build.SOURCE_DIR}"
        )
    path = cached_library_path()
    if path.is_file():
        return path
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


def _register(path: Path) -> None:
    library = ctypes.cdll.LoadLibrary(str(path))
    for target, symbol in TARGETS.items():
        handler = getattr(library, symbol)
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
            except (build.BuildError, OSError, AttributeError) as error:
                _result = LoadResult(path=None, reason=f"FFI library unavailable: {error}")
        return _result

"""The CUDA sources in ffi/ compile cleanly (warnings are errors) and export every handler."""

from __future__ import annotations

import ctypes
from pathlib import Path

import pytest

from omni_jax.ffi import build, library
from omni_jax.ffi.__main__ import main


def _toolchain_missing_reason() -> str | None:
    if build.find_nvcc() is None:
        return f"nvcc not found (set {build.NVCC_ENV_VAR}, PATH or CUDA_HOME) to compile ffi/*.cu"
    if build.find_cutlass_include() is None:
        return "CUTLASS headers not found: pip install 'omni-jax[ffi]' (nvidia-cutlass)"
    return None


needs_toolchain = pytest.mark.skipif(
    _toolchain_missing_reason() is not None, reason=str(_toolchain_missing_reason())
)


def test_there_are_sources():
    assert build.source_files(), f"no .cu files in {build.SOURCE_DIR}"


@pytest.mark.parametrize(
    "name,archs",
    [
        ("sparse_mla_sm90.cu", ("sm_90a",)),
        ("future_sm100.cu", ("sm_100a",)),
        ("generic.cu", build.DEFAULT_ARCHS),
    ],
)
def test_source_archs_follow_the_file_name(name, archs):
    assert build.source_archs(Path(name)) == archs


@pytest.fixture(scope="module")
def objects(tmp_path_factory) -> list[Path]:
    """Every source compiled for its archs with warnings as errors (the CI check)."""
    scratch = tmp_path_factory.mktemp("ffi_objects")
    compiled = []
    for source in build.source_files():
        archs = build.source_archs(source)
        if not archs:
            continue
        output = scratch / f"{source.stem}.o"
        build.compile_object(source, output, archs=archs, warnings_as_errors=True)
        compiled.append(output)
    return compiled


@needs_toolchain
def test_every_source_compiles_without_warnings(objects):
    assert len(objects) == len(build.source_files())


@needs_toolchain
def test_linked_library_exports_every_registered_handler(objects, tmp_path):
    linked = tmp_path / build.LIBRARY_NAME
    build.link_library(objects, linked)
    handle = ctypes.CDLL(str(linked))
    for symbol in library.TARGETS.values():
        assert hasattr(handle, symbol), f"{linked} does not export {symbol}"


def test_cli_help_names_the_commands(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--help"])
    assert exit_info.value.code == 0
    assert "build" in capsys.readouterr().out


def test_build_without_nvcc_fails_with_a_clear_message(monkeypatch, tmp_path, capsys):
    monkeypatch.setenv(build.NVCC_ENV_VAR, str(tmp_path / "no-nvcc"))
    assert main(["build", "--out", str(tmp_path / "lib.so")]) == 2
    assert "nvcc not found" in capsys.readouterr().err

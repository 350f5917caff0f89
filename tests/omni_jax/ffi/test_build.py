"""The CUDA sources in ffi/ compile cleanly (warnings are errors) and export every handler;
the command line reports a bad toolchain clearly, keys the cache by arch and builds nothing
in ``info``."""

from __future__ import annotations

import ctypes
from pathlib import Path

import pytest

from omni_jax.ffi import build, library
from omni_jax.ffi.__main__ import main


def _toolchain_missing_reason() -> str | None:
    try:
        build.find_toolchain()
    except build.BuildError as error:
        return f"cannot compile ffi/*.cu: {error}"
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


def _executable(path: Path, text: str, mode: int = 0o755) -> Path:
    path.write_text(text)
    path.chmod(mode)
    return path


@pytest.fixture
def fake_toolchain(monkeypatch, tmp_path) -> Path:
    """An nvcc that only prints a version, an include dir with cute/ and cutlass/, an empty
    build cache and no explicit or prebuilt library; returns the cache root."""
    nvcc = _executable(tmp_path / "nvcc", "#!/bin/sh\necho 'Cuda compilation tools, fake'\n")
    for name in ("cute", "cutlass"):
        (tmp_path / "include" / name).mkdir(parents=True)
    monkeypatch.setenv(build.NVCC_ENV_VAR, str(nvcc))
    monkeypatch.setenv(build.CUTLASS_ENV_VAR, str(tmp_path / "include"))
    monkeypatch.setenv(build.CACHE_ENV_VAR, str(tmp_path / "cache"))
    monkeypatch.delenv(library.LIBRARY_ENV_VAR, raising=False)
    monkeypatch.setattr(library, "PREBUILT_PATH", tmp_path / "no-prebuilt.so")
    return tmp_path / "cache"


@pytest.mark.parametrize(
    "variable,make_value,message",
    [
        (build.NVCC_ENV_VAR, lambda d: d / "missing", "is not a file"),
        (build.NVCC_ENV_VAR, lambda d: _executable(d / "nvcc", "", 0o644), "is not executable"),
        (build.NVCC_ENV_VAR, lambda d: _executable(d / "nvcc", "not a program"), "cannot run nvcc"),
        (build.CUTLASS_ENV_VAR, lambda d: d / "missing", "is not a directory"),
        (build.CUTLASS_ENV_VAR, lambda d: d, "has no cute/ or cutlass/ subdirectory"),
    ],
)
def test_build_with_a_bad_toolchain_variable_says_what_is_wrong(
    fake_toolchain, monkeypatch, tmp_path, capsys, variable, make_value, message
):
    bad = tmp_path / "bad"
    bad.mkdir()
    value = make_value(bad)
    monkeypatch.setenv(variable, str(value))
    assert main(["build", "--out", str(tmp_path / "out")]) == 2
    out, err = capsys.readouterr()
    assert str(value) in err and message in err
    assert "compiling" not in out  # the toolchain is checked before anything is announced
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("argv", [["--arch", "sm_80"], ["--jobs", "0"]])
def test_build_rejects_bad_arguments(argv, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["build", *argv])
    assert exit_info.value.code == 2
    assert argv[0] in capsys.readouterr().err


def test_build_for_fewer_archs_gets_its_own_cache_slot(fake_toolchain, monkeypatch):
    built = []
    monkeypatch.setattr(build, "build_library", lambda output, **kwargs: built.append(output))
    assert main(["build", "--arch", "sm_90a"]) == 0
    assert main(["build"]) == 0
    assert built == [library.cached_library_path(("sm_90a",)), library.cached_library_path()]
    assert built[0] != built[1]
    assert built[0].parent.name.startswith("sm_90a-")


@pytest.mark.parametrize(
    "device_arch,built_archs,found",
    [
        (None, build.DEFAULT_ARCHS, True),
        ("sm_90a", build.DEFAULT_ARCHS, True),
        ("sm_90a", ("sm_90a",), True),
        (None, ("sm_90a",), False),  # not built for every default arch: not the default one
        ("sm_100a", ("sm_90a",), False),
    ],
)
def test_lazy_lookup_takes_a_cached_build_only_for_archs_it_needs(
    fake_toolchain, monkeypatch, device_arch, built_archs, found
):
    monkeypatch.setattr(library, "device_arch", lambda: device_arch)
    path = library.cached_library_path(built_archs)
    path.parent.mkdir(parents=True)
    path.write_bytes(b"")
    assert library.find_library() == (path if found else None)


def _no_build(*args, **kwargs):
    raise AssertionError("info must not build")


@pytest.mark.parametrize(
    "library_file,expected",
    [
        (None, "library:          none: not built yet"),
        ("missing.so", "is not a file"),
        ("not-elf.so", "loads:            no:"),
    ],
)
def test_info_reports_without_building(
    fake_toolchain, monkeypatch, tmp_path, capsys, library_file, expected
):
    monkeypatch.setattr(build, "build_library", _no_build)
    if library_file is not None:
        (tmp_path / "not-elf.so").write_text("not a shared library")
        monkeypatch.setenv(library.LIBRARY_ENV_VAR, str(tmp_path / library_file))
    assert main(["info"]) == 1
    out = capsys.readouterr().out
    assert expected in out
    assert "kernels usable:   no" in out
    assert not fake_toolchain.exists()


def test_a_failed_compile_leaves_its_whole_log_and_names_it(fake_toolchain, tmp_path, capsys):
    """nvcc's output can run to thousands of lines: the error keeps the first, the rest
    is in a log beside the library, whose path the error (and the fallback warning) name."""
    failing = ("#!/bin/sh\n"
               "if [ \"$1\" = --version ]; then echo 'Cuda compilation tools'; exit 0; fi\n"
               "for i in $(seq 50); do echo \"error line $i\" >&2; done\nexit 1\n")
    _executable(tmp_path / "nvcc", failing)
    output = tmp_path / "out" / build.LIBRARY_NAME
    assert main(["build", "--out", str(output)]) == 2
    err = capsys.readouterr().err
    log = build.build_log_path(output)
    assert f"the whole build log: {log}" in err and "error line 50" not in err
    assert "error line 50" in log.read_text()

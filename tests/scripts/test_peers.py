"""scripts/peers.py: carry parts within a device call's limit, and an install from them
that imports as pip's would (the wheels, the repacked tars, the `.pth` import lines)."""

import base64
import hashlib
import importlib.util
import pathlib
import subprocess
import sys
import zipfile

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("peers", ROOT / "scripts" / "peers.py")
peers = sys.modules["peers"] = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(peers)


def test_parts_fit_and_keep_every_file():
    sizes = {"libs.tar.xz": 60, "fa3.whl": 22, "bindings.whl": 8, "base.whl": 3,
             "small.whl": 1}
    parts = peers.plan_parts(sizes, 61)
    assert sorted(n for part in parts for n in part) == sorted(sizes)
    assert all(sum(sizes[n] for n in part) <= 61 for part in parts)
    assert len(parts) == 2 and parts[0][0] == "libs.tar.xz"
    with pytest.raises(ValueError, match="libs.tar.xz is .* more than a part"):
        peers.plan_parts(sizes, 50)


def _wheel(folder: pathlib.Path, name: str, files: dict[str, str]) -> pathlib.Path:
    """A minimal wheel of ``files`` (path: text)."""
    info = f"{name}-1.0.dist-info"
    files = {**files, f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {name}\n"
             "Version: 1.0\n",
             f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\n"
             "Tag: py3-none-any\n"}
    record = []
    for path, text in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest())
        record.append(f"{path},sha256={digest.rstrip(b'=').decode()},{len(text)}")
    files[f"{info}/RECORD"] = "\n".join([*record, f"{info}/RECORD,,"]) + "\n"
    wheel = folder / f"{name}-1.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        for path, text in files.items():
            archive.writestr(path, text)
    return wheel


def test_install_from_parts_imports_like_pip(tmp_path):
    first, second = tmp_path / "carry1", tmp_path / "carry2"
    first.mkdir()
    second.mkdir()
    # The DSL's layout: its packages in a subfolder that a .pth import line adds, and a
    # libraries wheel (repacked as a tar) writing into the same top folder.
    _wheel(second, "dsl", {
        "dsl/__init__.py": "", "dsl/packages/dslcore/__init__.py": "VALUE = 1\n",
        "dsl.pth": "import sys, os, dsl; sys.path.insert(0, "
                   "os.path.join(dsl.__path__[0], 'packages'))\n"})
    libs = _wheel(first, "dsllibs", {"dsl/packages/dslcore/libs.py": "LIBS = 2\n"})
    tar = peers.repack_as_tar(libs)
    assert tar.name.endswith(".tar.xz") and not libs.exists()
    site = tmp_path / "site"
    for _ in range(2):  # a second install over the first (a warm machine) works alike
        path = peers.install(site, [first, second])
        assert str(site.resolve()) in path and str(site.resolve() / "dsl" / "packages") in path
        code = "import dslcore, dslcore.libs; print(dslcore.VALUE + dslcore.libs.LIBS)"
        out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True,
                             text=True, env={"PYTHONPATH": ":".join(path)}).stdout
        assert out.strip() == "3"
    with pytest.raises(SystemExit, match="carried parts missing"):
        peers.install(site, [tmp_path / "carry3"])

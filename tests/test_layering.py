"""The layers point one way: `benchmarks` -> `omni_jax` (API, semantics, dispatch) ->
`pallas_kernels` (kernels and what they need). A kernel file importing the API (or the
benchmarks) would tangle ownership; these tests name the file and line that does."""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]

# Each package and the top-level packages of this repository it must never import.
FORBIDDEN = {
    "pallas_kernels": ("omni_jax", "benchmarks", "tests"),
    "omni_jax": ("benchmarks", "tests"),
}


def imported_modules(path: pathlib.Path) -> list[tuple[int, str]]:
    """(line, module) of every import statement in ``path``, nested ones included."""
    tree = ast.parse(path.read_text(), filename=str(path))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.lineno, node.module))
    return found


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_no_import_points_up(package):
    offenders = [
        f"{path.relative_to(ROOT)}:{line} imports {module}"
        for path in sorted((ROOT / package).rglob("*.py"))
        for line, module in imported_modules(path)
        if module.split(".")[0] in FORBIDDEN[package]
    ]
    assert not offenders, "imports that point up a layer:\n" + "\n".join(offenders)


def test_importing_every_kernel_module_loads_no_api_module():
    """Catches what the source scan cannot: an import made through importlib."""
    modules = sorted(
        ".".join(path.relative_to(ROOT).with_suffix("").parts)
        for path in (ROOT / "pallas_kernels").rglob("*.py") if path.name != "__init__.py")
    script = (f"import importlib, sys\nfor m in {modules!r}: importlib.import_module(m)\n"
              "print(sorted({m.split('.')[0] for m in sys.modules} & {'omni_jax', 'benchmarks'}))")
    result = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True,
                            text=True, check=True)
    assert result.stdout.strip() == "[]"

"""The Python snippets of README.md and docs/*.md run as written."""

import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOCUMENTS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SNIPPETS = [(path, snippet) for path in DOCUMENTS
            for snippet in re.findall(r"```python\n(.*?)```", path.read_text(), flags=re.S)]


def _id(path: pathlib.Path, index: int) -> str:
    return f"{path.relative_to(ROOT)}:snippet{index}"


@pytest.mark.parametrize(("path", "snippet"), SNIPPETS, ids=[
    _id(path, sum(p == path for p, _ in SNIPPETS[:i])) for i, (path, _) in enumerate(SNIPPETS)])
def test_snippet_runs(path: pathlib.Path, snippet: str) -> None:
    exec(compile(snippet, str(path), "exec"), {})


"""The size budget (docs: /work/shared/STYLE.md, CONTRIBUTING.md): every production file under 400
lines, every function and method under 60, measured on the code as `ruff format` writes it (`make lint`
checks that layout), so `# fmt: skip` may not pack code to fit: at most 20 markers in the production
code, each with its reason on the same line (`# fmt: skip  # a table: ...`; ruff honours the marker
only as an exact comment, so the reason goes in a second comment after it)."""

from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]
# The production code, the vLLM server's package (`server/`) included.
PACKAGES = ("flows", "tasks", "storage", "examples", "server")
MAX_FILE_LINES = 400
MAX_FUNCTION_LINES = 60
MAX_FMT_SKIPS = 20
# A formatter marker, and what must follow it on its line: another comment that says why.
MARKER = re.compile(r"#\s*fmt:\s*(skip|off)\b")
REASON = re.compile(r"#\s*fmt:\s*(?:skip|off)\s*#\s*\S.{3,}")


def _sources() -> list[Path]:
    return sorted(p for pkg in PACKAGES if (REPO / pkg).is_dir() for p in (REPO / pkg).rglob("*.py"))


def _functions(tree: ast.AST, prefix: str = ""):
    """(qualified name, lines from the def line to the last, decorators excluded) of every function."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            name = f"{prefix}{node.name}"
            yield name, node.end_lineno - node.lineno + 1
            yield from _functions(node, f"{name}.")
        elif isinstance(node, ast.ClassDef):
            yield from _functions(node, f"{prefix}{node.name}.")
        else:
            yield from _functions(node, prefix)


def _markers(path: Path) -> list[tuple[int, str]]:
    """(line, comment) of each formatter marker: comments only, never a string that mentions one."""
    tokens = tokenize.generate_tokens(io.StringIO(path.read_text()).readline)
    return [(t.start[0], t.string) for t in tokens if t.type == tokenize.COMMENT and MARKER.search(t.string)]


def _rel(path: Path) -> str:
    return path.relative_to(REPO).as_posix()


def test_the_production_code_is_found():
    names = {_rel(p) for p in _sources()}
    assert "flows/train.py" in names or any(n.startswith("flows/") and n.endswith("/train.py") for n in names)
    assert any(n.startswith("tasks/") for n in names) and any(n.startswith("storage/") for n in names)


def test_every_file_is_under_the_line_budget():
    over = [
        f"{_rel(p)}: {n} lines" for p in _sources() if (n := len(p.read_text().splitlines())) > MAX_FILE_LINES
    ]
    assert not over, f"files over {MAX_FILE_LINES} lines (split them by responsibility):\n" + "\n".join(over)


def test_every_function_is_under_the_line_budget():
    over = [
        f"{_rel(p)}:{name}: {n} lines"
        for p in _sources()
        for name, n in _functions(ast.parse(p.read_text(), filename=str(p)))
        if n > MAX_FUNCTION_LINES
    ]
    assert not over, (
        f"functions over {MAX_FUNCTION_LINES} lines (def line to last line; extract a helper for a "
        "coherent piece):\n" + "\n".join(over)
    )


def test_fmt_skip_markers_are_few_and_each_says_why():
    found = [(p, line, comment) for p in _sources() for line, comment in _markers(p)]
    unexplained = [f"{_rel(p)}:{line}: {c}" for p, line, c in found if not REASON.search(c)]
    assert not unexplained, (
        "a formatter marker needs its reason on the same line, as `# fmt: skip  # a table: ...`:\n"
        + "\n".join(unexplained)
    )
    assert len(found) <= MAX_FMT_SKIPS, (
        f"{len(found)} formatter markers in the production code (at most {MAX_FMT_SKIPS}); let ruff "
        "format lay the code out:\n" + "\n".join(f"{_rel(p)}:{line}" for p, line, _ in found)
    )


def test_the_checks_catch_an_offender(tmp_path):
    """The measures themselves: a 61-line function, a method, and markers with and without a reason."""
    body = "\n".join(f"    x{i} = {i}" for i in range(59))
    src = f"class A:\n    @staticmethod\n    def long():\n{body.replace('    ', '        ')}\n        return 0\n"
    assert dict(_functions(ast.parse(src))) == {"A.long": 61}
    f = tmp_path / "m.py"
    f.write_text(
        'x = [1,  2]  # fmt: skip\ny = [1,  2]  # fmt: skip  # a table: one row per thing\ns = "# fmt: skip"\n'
    )
    markers = _markers(f)
    assert [line for line, _ in markers] == [1, 2]
    assert [bool(REASON.search(c)) for _, c in markers] == [False, True]

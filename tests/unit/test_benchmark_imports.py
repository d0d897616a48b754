"""The benchmarks and scripts import grpoflow's packages by their one import name. Four benchmarks kept
`import flows` (inside their functions, so nothing but a full run reached it) after the packages became
`grpoflow.flows`, `grpoflow.tasks`, ... and failed at once when run; no test runs them, so this reads
their imports instead."""

from __future__ import annotations

import ast

import pytest

from tests.support import REPO

OLD_NAMES = {"flows", "tasks", "storage", "server"}  # each imports only as grpoflow.<name>
FILES = sorted([*(REPO / "benchmarks").glob("*.py"), *(REPO / "scripts").glob("*.py")])


def _absolute_imports(path) -> list[tuple[int, str]]:
    """(line, module) of every absolute import in the file, at any depth."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.append((node.lineno, node.module))
    return out


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.relative_to(REPO).as_posix())
def test_no_benchmark_or_script_imports_a_package_by_its_old_name(path):
    old = [
        f"{path.name}:{line} imports {m}"
        for line, m in _absolute_imports(path)
        if m.split(".")[0] in OLD_NAMES
    ]
    assert not old, f"import grpoflow.<package> instead: {old}"


def test_the_check_sees_an_import_inside_a_function(tmp_path):
    f = tmp_path / "bench.py"
    f.write_text("def run():\n    import flows  # noqa\n    from storage.sql import query\n")
    assert _absolute_imports(f) == [(2, "flows"), (3, "storage.sql")]

"""grpoflow.server, what the vLLM server imports from grpoflow, is a leaf whose dependencies are written
down: each import of each of its modules is the standard library, grpoflow.server itself, or a name
its two lists give (server/__init__.py). What the vLLM environment actually imports and has is
tests/integration/test_server_env.py."""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
import tomllib

import pytest

from grpoflow import server
from grpoflow.server import guard, protocol
from grpoflow.storage.processes import guarded
from tests.support import REPO, server_imports, wait_for

pytestmark = pytest.mark.unit


def _top(name: str) -> str:
    return name.partition(".")[0]


def test_every_import_of_the_server_package_is_stdlib_its_own_or_written_down():
    listed = {*server.REQUIRES, *server.PROVIDED_BY_VLLM}
    for module, names in server_imports().items():
        for name in names:
            own = name == "grpoflow.server" or name.startswith("grpoflow.server.")
            assert own or _top(name) in sys.stdlib_module_names | listed, f"server/{module} imports {name}"
    # Each listed name is used, or the list lies the other way.
    used = {_top(n) for names in server_imports().values() for n in names}
    assert listed <= used, listed - used


def test_the_protocol_is_standard_library_only():
    assert all(_top(n) in sys.stdlib_module_names for n in server_imports()["protocol.py"])


def test_the_package_declares_what_it_requires():
    meta = tomllib.loads((REPO / "server" / "pyproject.toml").read_text())
    declared = {re.match(r"[A-Za-z0-9_.-]+", d).group() for d in meta["project"]["dependencies"]}
    assert declared == set(server.REQUIRES)
    assert meta["tool"]["setuptools"]["packages"] == ["grpoflow.server"]


def test_the_worker_extension_defines_the_methods_the_client_calls():
    # Not imported here: importing it installs its hooks into vLLM, which this environment lacks.
    tree = ast.parse((REPO / "server" / "merge.py").read_text())
    module, _, cls = protocol.WORKER_EXTENSION.rpartition(".")
    assert module == "grpoflow.server.merge"
    [node] = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls]
    methods = {n.name for n in node.body if isinstance(n, ast.FunctionDef)}
    assert {protocol.RELOAD_RPC, protocol.MERGE_LORA_RPC} <= methods


def test_a_guard_is_recognised_by_its_command_line():
    argv = guard.command("/py", 41, "vllm.entrypoints.openai.api_server", ["--port", "9"])
    assert argv[:5] == ["/py", "-m", "grpoflow.server.guard", "41", "vllm.entrypoints.openai.api_server"]
    assert guard.watched_parent(argv) == 41
    for other in (
        ["/py", "-m", "other", "41", "m"],
        ["/py", "guard.py", "41", "m"],
        ["/py", "-m", guard.MODULE],
    ):
        assert guard.watched_parent(other) is None
    # A live one in the process table: the guard running `timeit` (a module that runs until killed).
    cmd = guard.command(sys.executable, os.getpid(), "timeit", ["-n", "1", "import time; time.sleep(600)"])
    proc = subprocess.Popen(cmd, start_new_session=True)
    try:
        wait_for(lambda: (proc.pid, os.getpid()) in guarded(), 20, "the guard in the process table")
    finally:
        proc.kill()
        proc.wait(10)


def test_a_vllm_environment_without_the_package_is_refused_before_anything_starts(tmp_path):
    from grpoflow.flows.processes.serve import require_server_package

    require_server_package(sys.executable)  # grpoflow's environment has it (the main pyproject.toml too)
    bare = tmp_path / "python"
    bare.write_text("#!/bin/sh\necho \"ModuleNotFoundError: No module named 'grpoflow'\" >&2\nexit 1\n")
    bare.chmod(0o755)
    with pytest.raises(
        RuntimeError, match=r"cannot import grpoflow.server .*pip install --no-deps -e .*server"
    ):
        require_server_package(str(bare))

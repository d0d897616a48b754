"""The real build of the package: setuptools says nothing about packages it would leave out (a fresh
clone's `make install` / `make demo` once opened with a 40-line warning block about
`flows.vllm_plugins`), and the wheel carries the vLLM server's package (grpoflow.server) and the
explorer's page, all under the one import name `grpoflow`."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SOURCES = ["flows", "tasks", "storage", "examples", "server"]


@pytest.mark.unit
def test_the_wheel_builds_without_a_warning_and_carries_the_server_package(tmp_path):
    # A copy: the build writes build/ and *.egg-info next to pyproject.toml, never into the checkout.
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, src / name)
    for name in SOURCES:
        shutil.copytree(REPO / name, src / name, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    # No build isolation and no index: setuptools from this environment, no network.
    cmd = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index",
           str(src), "-w", str(tmp_path / "dist")]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    log = out.stdout + out.stderr
    assert out.returncode == 0, log
    assert "absent from the `packages` configuration" not in log
    assert "Warning" not in log, log
    (wheel,) = (tmp_path / "dist").glob("grpoflow-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    server = {f"grpoflow/server/{p.name}" for p in (REPO / "server").glob("*.py")}
    assert {"grpoflow/server/guard.py", "grpoflow/server/protocol.py"} <= server <= names
    page = {
        f"grpoflow/flows/viewing/ui_static/{name}" for name in ("index.html", "app.js", "style.css")
    }  # grpoflow ui
    assert page <= names
    # One import name: every module under grpoflow/, none at the top level where a user's would be.
    tops = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert tops == {"grpoflow"}, tops
    assert {f"grpoflow/{pkg}/__init__.py" for pkg in SOURCES} <= names

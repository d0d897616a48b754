"""A user's own reward, tool and dataset next to their config, used from another directory with no
PYTHONPATH: imports (thread and process rewards alike), relative data paths, and the errors."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from tests.support import USER_CONFIG, user_project

pytestmark = pytest.mark.unit


def _run(code: str, cwd) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_modules_and_data_beside_the_config_work_from_another_directory(tmp_path):
    proj, elsewhere = user_project(tmp_path)
    out = _run(
        f"""
        from grpoflow.flows.config import load_config
        from grpoflow.flows.training.preflight import preflight
        from grpoflow.storage.records import RolloutCompletion, RolloutGroup
        from grpoflow.tasks.rewards.score import score_groups

        cfg = load_config({str(proj / "cfg.yaml")!r})
        rows = preflight(cfg)  # imports every path, reads the rows
        comps = [RolloutCompletion(i, t, [1], [1], [-1.0]) for i, t in enumerate(["2", "3"])]
        g = RolloutGroup("g", 0, "p", [1], comps, row=rows[0])
        score_groups([g], cfg.rewards)  # the config's own reward sections, as the flow passes them
        print(len(rows), [[c.status for c in x.reward_cells] for x in comps], comps[0].reward)
        """,
        cwd=elsewhere,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split("\n")[0] == "2 [['valid', 'valid'], ['valid', 'valid']] 2.0"


def _preflight_error(cfg_path, cwd) -> str:
    """Preflight of `cfg_path` in a fresh interpreter started in `cwd`; returns the ConfigError text."""
    out = _run(
        f"""
        from grpoflow.flows.config import ConfigError, load_config
        from grpoflow.flows.training.preflight import preflight
        try:
            preflight(load_config({str(cfg_path)!r}))
        except ConfigError as e:
            print(e)
        """,
        cwd=cwd,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout


def test_a_module_that_cannot_be_imported_names_the_directories_searched(tmp_path):
    proj, elsewhere = user_project(tmp_path)
    (proj / "cfg.yaml").write_text(USER_CONFIG.replace("tasks:exact", "no_such_task:exact"))
    error = _preflight_error(proj / "cfg.yaml", elsewhere)
    assert "rewards[0].fn" in error and "no_such_task" in error
    assert str(proj) in error and str(elsewhere) in error


def test_a_missing_data_file_names_both_places_looked(tmp_path):
    proj, elsewhere = user_project(tmp_path)
    (proj / "cfg.yaml").write_text(USER_CONFIG.replace("data.jsonl", "gone.jsonl"))
    error = _preflight_error(proj / "cfg.yaml", elsewhere)
    assert str(elsewhere / "gone.jsonl") in error and str(proj / "gone.jsonl") in error


def test_grpoflow_leaves_the_names_tasks_flows_storage_server_and_examples_to_the_user(tmp_path):
    # Installed, grpoflow is `grpoflow.*` alone: in a folder without modules of those names, none imports.
    out = _run(
        """
        import importlib.util
        print([n for n in ("tasks", "flows", "storage", "server", "examples") if importlib.util.find_spec(n)])
        import grpoflow.tasks, grpoflow.flows, grpoflow.storage, grpoflow.server, grpoflow.examples
        """,
        cwd=tmp_path,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip() == "[]"

"""`grpoflow train --config that/dir/cfg.yaml` with the user's own reward, tool and dataset beside the
config, run from another directory with no PYTHONPATH: real CLI, real vLLM server, real Prefect API."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from grpoflow.storage.sql import query
from tests.support import user_project

pytestmark = pytest.mark.integration


def test_train_with_a_users_own_reward_tool_and_data_beside_the_config(
    tmp_path, vllm_server, tiny_model_dir, prefect_api
):
    from prefect.settings import PREFECT_API_URL

    _, elsewhere = user_project(tmp_path)
    root = tmp_path / "runs"
    sets = [
        f"model.path={tiny_model_dir}",
        f"inference.url={vllm_server.url}",
        "run.steps=2",
        "run.run_id=mine",
        "data.prompts_per_step=2",
        "generation.group_size=2",
        "generation.max_tokens=8",
        "generation.max_turns=2",
    ]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PREFECT_API_URL"] = str(PREFECT_API_URL.value())
    cmd = [
        sys.executable,
        "-m",
        "grpoflow.flows.cli.main",
        "train",
        "--config",
        "../proj/cfg.yaml",
        "--root",
        str(root),
    ]
    cmd += [a for s in sets for a in ("--set", s)]
    out = subprocess.run(cmd, cwd=elsewhere, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    _, rows = query(root, "SELECT reward_name, status, count(*) FROM rewards GROUP BY ALL ORDER BY ALL")
    assert rows == [("exact", "valid", 8), ("exact_in_a_process", "valid", 8)]

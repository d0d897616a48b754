"""LoRA runs end to end on the real vLLM CPU server: grpo-train pushing adapters through SIGKILLs at
failpoints and resumes, and a LoRA run refused by a server that loads no adapters. SmolLM2's adapter
tests are test_smollm2.py's, on its one SmolLM2 server."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from grpoflow.storage.sql import query
from tests.drill import STEP_POINTS, clean_store, random_kill_drill, store_check
from tests.support import REPO

pytestmark = [pytest.mark.integration, pytest.mark.memory_heavy]


@pytest.mark.slow
def test_a_lora_run_killed_at_random_failpoints_resumes_with_every_table_exactly_once(
    tmp_path, lora_server, tiny_model_dir, prefect_api
):
    from prefect.settings import PREFECT_API_URL

    steps, per_step = 6, 8 * 8
    sets = [
        f"model.path={tiny_model_dir}",
        f"inference.url={lora_server.url}",
        f"run.steps={steps}",
        "run.checkpoint_every=2",
        "algorithm.max_staleness=1",
        "learner.lora={rank: 8, alpha: 16}",
    ]
    # seed 0 plans train@2, weight_push@2: a LoRA update, an adapter push (STEP_POINTS: no compaction)
    fig = random_kill_drill(tmp_path, "lora-drill", sets, kills=2, seed=0, points=STEP_POINTS,
                            env={"PREFECT_API_URL": str(PREFECT_API_URL.value())})  # fmt: skip
    # Each planned (point, hit) was reached and killed its launch, as the store's kill records say.
    assert fig["exit_codes"] == [-9, -9] and fig["fired"] == [[p] for p in fig["planned"]], fig
    assert fig["completed"], fig["final_output"]
    assert fig["orphans"] == 0 and fig["statuses_after_kill"] == ["interrupted"] * 2, fig
    assert store_check(tmp_path, "lora-drill", steps, per_step) == clean_store(steps), fig
    # Only adapters travelled: every kept version and checkpoint holds the adapter, never a model.
    versions = sorted((tmp_path / "weights" / "lora-drill").glob("v*"))
    assert versions and all((v / "adapter_model.safetensors").is_file() for v in versions)
    assert not list((tmp_path / "weights").rglob("model.safetensors"))
    ckpt = max((tmp_path / "checkpoints" / "lora-drill").glob("step-*"))
    assert (ckpt / "adapter" / "adapter_config.json").is_file() and not (ckpt / "model").exists()
    # The server serves the last version's adapter, and the steps record the version pushed.
    models = json.loads(_get(f"{lora_server.url}/v1/models"))["data"]
    assert f"lora-drill@v{steps}" in {m["id"] for m in models}
    _, rows = query(tmp_path, "SELECT max(policy_version) FROM steps WHERE run_id = 'lora-drill'")
    assert rows[0][0] == steps


def _get(url: str) -> str:
    import urllib.request

    with urllib.request.urlopen(url, timeout=10) as r:
        return r.read().decode()


def test_a_lora_run_against_a_server_without_lora_fails_before_its_first_step(
    tmp_path, vllm_server, tiny_model_dir, prefect_api
):
    """The shared server was started as full fine-tuning runs start theirs: it loads no adapters."""
    from prefect.settings import PREFECT_API_URL

    from grpoflow.storage.rollouts import RolloutStore

    sets = [f"storage.root={tmp_path}", f"model.path={tiny_model_dir}", f"inference.url={vllm_server.url}",
            "run.steps=2", "learner.lora={rank: 8}"]  # fmt: skip
    out = subprocess.run(
        [sys.executable, "-m", "grpoflow.flows.cli.main", "train", "--run-id", "no-lora", *[a for s in sets for a in ("--set", s)]],
        cwd=REPO, capture_output=True, text=True, timeout=300,
        env={**os.environ, "PREFECT_API_URL": str(PREFECT_API_URL.value())},
    )  # fmt: skip
    assert out.returncode == 2, out.stderr[-3000:]
    errors = [line for line in out.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, out.stderr[-3000:]
    assert "learner.lora" in errors[0] and vllm_server.url in errors[0], errors[0]
    assert RolloutStore(tmp_path).read_run_meta("no-lora")["status"] == "failed"
    assert not list(tmp_path.glob("steps/**/*.parquet"))  # not one step ran

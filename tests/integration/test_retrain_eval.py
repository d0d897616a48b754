"""grpo-retrain, grpo-evaluate and rollout-sql flows on the real Prefect API and vLLM server."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from grpoflow.flows.config import load_config
from grpoflow.storage.rollouts import RolloutStore
from grpoflow.storage.sql import query

pytestmark = pytest.mark.integration
REPO = Path(__file__).resolve().parents[2]


def always_fails(completions: list[str], **_) -> list[float]:
    raise RuntimeError("probe")


def test_retrain_twice_then_evaluate_and_query(tmp_path, vllm_server, tiny_model_dir, prefect_api):
    from grpoflow.flows.lineage.retrain import grpo_retrain
    from grpoflow.flows.viewing.analyze import rollout_sql

    cfg = load_config(REPO / "configs" / "tiny-letters.yaml", [
        f"storage.root={tmp_path}", f"model.path={tiny_model_dir}", f"inference.url={vllm_server.url}",
        "run.checkpoint_every=2", "data.prompts_per_step=4",
    ])  # fmt: skip
    # evaluation on the shared server too (its weights are replaced; the default is an own server)
    shared = {"eval_prompts": 4, "eval_server_url": vllm_server.url}
    first = grpo_retrain(lineage="nightly", extra_steps=3, config=cfg, **shared)
    second = grpo_retrain(lineage="nightly", extra_steps=2, config=cfg, **shared)
    assert first["train"]["steps_trained"] == 3 and second["train"]["steps_trained"] == 2
    store = RolloutStore(tmp_path)
    assert store.steps_written("steps", "nightly") == [0, 1, 2, 3, 4]
    meta = store.read_run_meta("nightly")
    assert [(r["from_step"], r["to_step"]) for r in meta["retrains"]] == [(0, 2), (3, 4)]
    # evaluation rows: split='eval', one file per evaluated checkpoint step, pass rate published
    assert store.steps_written("rollouts", "nightly-eval") == [2, 4]
    _, rows = query(
        tmp_path, "SELECT DISTINCT split, count(*) OVER () FROM rollouts WHERE run_id = 'nightly-eval'"
    )
    assert rows == [("eval", 2 * 4 * 8)]
    assert 0.0 <= second["eval"]["pass_rate"] <= 1.0 and second["eval"]["completions"] == 32

    # greedy: one completion per prompt at temperature 0 (the training config itself refuses 0)
    from grpoflow.flows.lineage.evaluate import grpo_evaluate

    greedy = grpo_evaluate(config=cfg, run_id="nightly", prompts=4, greedy=True, server_url=vllm_server.url)
    assert greedy["completions"] == 4 and cfg.generation.temperature > 0
    _, texts = query(tmp_path, "SELECT completion FROM rollouts WHERE run_id = 'nightly-eval' AND step = 4 "
                     "ORDER BY prompt_index")  # fmt: skip
    assert len(texts) == 4

    # A required reward that failed on every completion is a bug, not a pass rate of 0: the evaluation
    # raises, naming it, once its rows are stored.
    from grpoflow.tasks.config.rewards import RewardConfig
    from grpoflow.tasks.rewards.broken_rewards import BrokenRewardError

    broken = cfg.model_copy(update={"rewards": [RewardConfig(name="probe", fn=f"{__name__}:always_fails")]})
    with pytest.raises(
        BrokenRewardError, match=r"evaluation .*'probe' failed on 4/4 completions: RuntimeError: probe"
    ):
        grpo_evaluate(config=broken, run_id="nightly", prompts=4, greedy=True, server_url=vllm_server.url,
                      eval_run="broken-eval")  # fmt: skip
    assert RolloutStore(tmp_path).steps_written("rewards", "broken-eval") == [4]

    out = rollout_sql(root=str(tmp_path), canned="reward_curve", run="nightly")
    assert out["rows"] == 5

    async def artifact():
        from prefect.client.orchestration import get_client

        async with get_client() as c:
            return [a for a in await c.read_artifacts() if a.key == "rollout-sql"]

    assert asyncio.run(artifact())

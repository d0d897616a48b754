"""Gated promotion into a live vLLM server, on the real servers and the real Prefect API.

Two servers: the session's shared one trains and evaluates (grpo-retrain's `eval_server_url`), and
its second (`lora_server`) plays the live `policy-server` users are served from; only promotions and
rollbacks touch it. Its greedy completions are compared with the shared server's after the same weights
are loaded there (vLLM against vLLM)."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from grpoflow.flows.config import load_config
from grpoflow.storage.ids import held_out
from grpoflow.storage.sql import query

pytestmark = pytest.mark.integration
REPO = Path(__file__).resolve().parents[2]
PROMPTS = ["Write a word like cat with many letters a.", "Write a word like banana with many letters a."]


@pytest.fixture
def live_server(lora_server, tiny_model_dir, tmp_path):
    """The live `policy-server`: the session's second server (`lora_server`, started as LoRA runs start
    theirs, which takes full-weight loads too; a server of its own cost the suite ~50 s), holding the
    base weights whatever the LoRA tests before this one loaded into it."""
    from grpoflow.tasks.config.inference import InferenceConfig, SyncConfig
    from grpoflow.tasks.push.push import load_version, weight_push

    pusher = weight_push(
        tmp_path / "live-base", "live-base", SyncConfig(), InferenceConfig(), reset_prefix_cache=True
    )
    load_version(pusher, lora_server.url, tiny_model_dir, 0)
    return lora_server


def greedy(url: str, tok) -> list[list[int]]:
    from grpoflow.tasks.rollouts.inference import VLLMClient

    async def go():
        async with VLLMClient(url) as c:
            return [
                (await c.complete(tok.encode(p, add_special_tokens=False), max_tokens=10, temperature=0.0))[
                    0
                ].token_ids
                for p in PROMPTS
            ]

    return asyncio.run(go())


def test_promote_reject_rollback_on_a_live_server(
    tmp_path, vllm_server, live_server, tiny_model_dir, prefect_api, capsys
):
    from transformers import AutoTokenizer

    from grpoflow.flows.cli import main as cli
    from grpoflow.flows.lineage.retrain import grpo_retrain
    from grpoflow.tasks.config.inference import InferenceConfig, SyncConfig
    from grpoflow.tasks.push.push import load_version, weight_push

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    sets = [
        f"storage.root={tmp_path}", f"model.path={tiny_model_dir}", f"inference.url={vllm_server.url}",
        "data.eval_fraction=0.25", "algorithm.max_staleness=0", "run.checkpoint_every=100",
    ]  # fmt: skip
    # Pinned: seed 0, on-policy (max_staleness 0 reproduces as it is): the candidate trained here and its
    # eval are the same bits every run, so "it beats the base" below depends on no timing.
    cfg = load_config(REPO / "configs" / "tiny-letters.yaml", sets)
    gated = {"server_url": live_server.url, "eval_server_url": vllm_server.url}
    base_out = greedy(live_server.url, tok)

    first = grpo_retrain(lineage="prod", extra_steps=6, config=cfg, **gated)
    assert first["decision"]["decision"] == "promoted", first["decision"]["reason"]
    assert first["eval"]["reward_mean"] > first["incumbent_eval"]["reward_mean"]
    assert first["eval"]["rows"] == "eval"
    promoted_out = greedy(live_server.url, tok)
    pusher = weight_push(tmp_path, "cmp", SyncConfig(), InferenceConfig())
    load_version(pusher, vllm_server.url, first["decision"]["candidate_path"], 99)
    assert greedy(vllm_server.url, tok) == promoted_out != base_out  # the live server serves the candidate

    # More data, and a deliberately worse retrain: a KL penalty 100x the reward pulls the policy back
    # toward the base model (a destroying learning rate would not do: on this task it collapses the
    # model onto the letter "a", the best possible reply). Rejected; the server is unchanged.
    worse_sets = [*sets, "algorithm.beta=100", "learner.lr=0.02", "data.generator_kwargs.n=96"]
    worse = load_config(REPO / "configs" / "tiny-letters.yaml", worse_sets)
    second = grpo_retrain(lineage="prod", extra_steps=3, config=worse, **gated)
    assert second["eval"]["reward_mean"] < second["incumbent_eval"]["reward_mean"]
    assert second["decision"]["decision"] == "rejected"
    assert greedy(live_server.url, tok) == promoted_out

    # The command line: a rollback to the base model, and bad input named in one line.
    root = ["--root", str(tmp_path)]
    assert cli.main(["rollback", "prod", "--server", live_server.url, *root]) == 0
    assert "prod: rolled back to the base model" in capsys.readouterr().out
    assert greedy(live_server.url, tok) == base_out
    assert cli.main(["rollback", "prod", *root]) == 2
    assert "error: lineage 'prod' has no promoted version to roll back from" in capsys.readouterr().err
    assert cli.main(["promote", "prod", "--step", "99", *root]) == 2
    assert "no checkpoint at step 99 (it has [5, 8])" in capsys.readouterr().err

    _, rows = query(tmp_path, "SELECT decision, candidate_step, candidate_score, incumbent_score, server "
                       "FROM promotions WHERE lineage = 'prod' ORDER BY decision_id")  # fmt: skip
    assert [r[0] for r in rows] == ["promoted", "rejected", "rolled_back"]
    assert rows[0][1] == 5 and rows[1][1] == 8 and all(r[4] == live_server.url for r in rows)
    assert (
        rows[0][2] == first["eval"]["reward_mean"] and rows[1][3] == second["incumbent_eval"]["reward_mean"]
    )

    # Eval rows never appear in a training step, also after the data grew from 64 to 96 rows.
    _, trained = query(
        tmp_path, "SELECT DISTINCT row_id FROM rollouts WHERE run_id = 'prod' AND split = 'train'"
    )
    _, evaluated = query(tmp_path, "SELECT DISTINCT row_id FROM rollouts WHERE run_id LIKE 'prod-eval%'")
    trained, evaluated = {r[0] for r in trained}, {r[0] for r in evaluated}
    assert trained and evaluated and not trained & evaluated
    assert not any(held_out(r, 0.25) for r in trained) and all(held_out(r, 0.25) for r in evaluated)
    assert any(int(r) >= 64 for r in evaluated)  # rows added later are held out too

    # Each decision is a Prefect event on the lineage's resource (delivered asynchronously).
    from prefect.client.orchestration import get_client
    from prefect.events.filters import EventFilter, EventNameFilter, EventResourceFilter

    wanted = ["grpoflow.policy.promoted", "grpoflow.policy.rejected", "grpoflow.policy.rolled_back"]
    names: list[str] = []
    for _ in range(40):
        with get_client(sync_client=True) as client:
            page = client.read_events(EventFilter(event=EventNameFilter(prefix=["grpoflow.policy."]),
                                                  resource=EventResourceFilter(id=["grpoflow.lineage.prod"])), limit=50)  # fmt: skip
        names = sorted(e.event for e in page.events)
        if names == wanted:
            break
        time.sleep(0.5)
    assert names == wanted

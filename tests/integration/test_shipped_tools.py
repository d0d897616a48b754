"""Every shipped CPU config with tools stores tool calls when run as shipped: a random tiny model never
writes one, so those configs carry a `warmup` section, and the warm-up must teach the format on the
very prompts the rollouts are generated from."""

from __future__ import annotations

from pathlib import Path

import pytest

from grpoflow.flows.config import load_config
from grpoflow.storage.sql import query

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]


def test_counter_env_config_stores_tool_calls_after_its_warm_up(
    tmp_path, vllm_server, tiny_model_dir, prefect_api, counter_env_warmup
):
    from grpoflow.flows.training.data import load_rows
    from grpoflow.flows.training.runs import prepare_model
    from grpoflow.flows.training.train import grpo_train
    from grpoflow.tasks.rollouts.templates import load_tokenizer, render
    from grpoflow.tasks.rollouts.tools import HermesToolParser
    from grpoflow.tasks.warmup import PromptRenderer

    cfg = load_config(
        REPO / "configs" / "tiny-counter-env.yaml",
        [f"storage.root={tmp_path}", f"model.path={tiny_model_dir}", f"inference.url={vllm_server.url}",
         "run.steps=2", "run.run_id=counter"],
    )  # fmt: skip
    counter_env_warmup(tmp_path)  # the config's warm-up, run once a session (tests/integration/conftest.py)
    assert grpo_train(config=cfg)["steps_trained"] == 2
    _, [(calls, ok, max_count)] = query(
        tmp_path,
        "SELECT count(*), count(*) FILTER (WHERE NOT failed AND result LIKE 'count is now %'), "
        "(SELECT max(value) FROM rewards WHERE reward_name = 'CounterEnv') FROM tool_calls",
    )
    # parsed, executed on the environment, rewarded by its get_reward() (TRL's environment_factory): the
    # config names no reward function, and every cell of the environment's reward is valid
    assert calls > 0 and ok > 0 and max_count >= 1
    _, statuses = query(tmp_path, "SELECT DISTINCT reward_name, status FROM rewards")
    assert statuses == [("CounterEnv", "valid")]

    # the warm-up learned on exactly the prompt text rollouts used (the env's reset note included)
    tok = load_tokenizer(str(prepare_model(cfg)))
    renderer = PromptRenderer(tok, cfg.tools, HermesToolParser())
    rendered = {
        render(tok, renderer.messages(r, i), renderer.schemas(r), True) for i, r in enumerate(load_rows(cfg))
    }
    _, prompts = query(tmp_path, "SELECT DISTINCT prompt FROM rollouts")
    assert prompts and {p for (p,) in prompts} <= rendered


def test_the_dict_form_shows_each_rows_rollouts_only_its_environments_tools(
    tmp_path, vllm_server, tiny_model_dir, prefect_api
):
    """TRL's `environment_factory={name: factory}`: each row's `environment` column picks the environment;
    its rollouts' stored prompts name only its tools, and each class's get_reward() is a reward column of
    its own (TRL 1.16: named after the class, weight 1), `invalid` "not this rollout's environment" for
    the other class's rollouts, which it never masks."""
    import json

    from grpoflow.flows.training.train import grpo_train

    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps({"prompt": [{"role": "user", "content": f"Task {i}."}], "id": i,
                                        "environment": ["counter", "echo"][i % 2]}) + "\n" for i in range(4)))  # fmt: skip
    cfg = load_config(REPO / "configs" / "tiny-counter-env.yaml", [
        f"storage.root={tmp_path}", f"model.path={tiny_model_dir}", f"inference.url={vllm_server.url}",
        "run.steps=1", "run.run_id=dict", f"data.path={rows}", "warmup.steps=0", "warmup.examples=null",
        "data.prompts_per_step=4", "generation.group_size=2", "generation.max_turns=2",
    ])  # fmt: skip
    cfg.tools.environment = {
        "counter": "grpoflow.examples.envs:CounterEnv",
        "echo": "tests.unit.envs:EchoEnv",
    }
    assert grpo_train(config=cfg)["steps_trained"] == 1
    _, got = query(tmp_path, "SELECT DISTINCT row_id, prompt FROM rollouts")
    assert len(got) == 4
    for row_id, prompt in got:
        mine, other = ('"increment"', '"echo"') if int(row_id) % 2 == 0 else ('"echo"', '"increment"')
        assert mine in prompt and other not in prompt, (row_id, prompt)
    _, cells = query(
        tmp_path,
        "SELECT w.reward_name, w.weight, o.row_id::INT % 2 = 0 AS counter, w.status, w.reason, count(*) "
        "FROM rewards w JOIN rollouts o USING (run_id, step, group_id, sample_index) GROUP BY ALL ORDER BY ALL",
    )
    other = "not this rollout's environment"
    assert [(n, w, mine, status, reason if status == "invalid" else "", k) for n, w, mine, status, reason, k in cells] == [
        ("CounterEnv", 1.0, False, "invalid", other, 4), ("CounterEnv", 1.0, True, "valid", "", 4),
        ("EchoEnv", 1.0, False, "valid", "", 4), ("EchoEnv", 1.0, True, "invalid", other, 4),
    ]  # fmt: skip
    _, [(valid,)] = query(tmp_path, "SELECT bool_and(reward_valid) FROM rollouts")
    assert valid  # no rollout masked by the other class's column

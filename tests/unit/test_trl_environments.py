"""TRL's `environment_factory` as it is (issue 48, part 1): get_reward() as a reward of its own, the dict
form chosen per row, an environment that owns its data. Rollouts run against the SCRIPTED FAKE backend
(tests/unit/scripted.py) with the real tiny tokenizer; config checks are the real ones."""

from __future__ import annotations

import asyncio
import json
import math

import pytest

import grpoflow.tasks.rollouts.generate as gen
from grpoflow.flows.config import ConfigError, GRPOConfig, load_config
from grpoflow.flows.training.environments import check_run
from grpoflow.tasks.config.rewards import RewardConfig
from grpoflow.tasks.config.rollouts import GenerationConfig, ToolsConfig
from grpoflow.tasks.rewards.env_reward import ENVIRONMENT_REWARD
from grpoflow.tasks.rewards.score import reward_metrics, score_groups
from grpoflow.tasks.tiny_model import build_tokenizer
from tests.unit.scripted import ScriptedBackend, one_server

pytestmark = pytest.mark.unit
LETTER = {"name": "letter", "fn": "grpoflow.examples.rewards:letter_fraction"}


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


def call(name, **args):
    return f"<tool_call>{json.dumps({'name': name, 'arguments': args})}</tool_call>"


def generate(tok, rows, tools: ToolsConfig, script=None, group_size=2):
    async def done(text, k, seed):
        return "done"

    return asyncio.run(
        gen.generate_groups(
            rows,
            list(range(len(rows))),
            servers=one_server(ScriptedBackend(tok, script or done, 8192)),
            tokenizer=tok,
            generation=GenerationConfig(group_size=group_size, max_tokens=64, max_turns=3),
            tools=tools,
            seed=0,
        )
    )


def env_spec(name: str) -> RewardConfig:
    return RewardConfig(name=name, fn=ENVIRONMENT_REWARD)


def test_get_reward_is_a_cell_of_its_own_on_each_rollouts_instance(tok):
    """CounterEnv's get_reward() (its count) is read on each rollout's own instance, before the pooled
    slot is reset for the next rollout: the cell equals the increments that rollout made."""
    from grpoflow.examples.envs import CounterEnv

    async def script(text, k, seed):
        return call("increment", by=2) if "<tool_response>" not in text and "more" in text else "done"

    groups = generate(tok, [{"prompt": "count"}, {"prompt": "count more"}],
                      ToolsConfig(environment=CounterEnv, env_slots=1), script)  # fmt: skip
    score_groups(groups, [env_spec("CounterEnv")])
    cells = [(g.row["prompt"], c.reward_cells[0]) for g in groups for c in g.completions]
    assert [(p, x.status, x.value) for p, x in cells] == [("count", "valid", 0.0)] * 2 + [
        ("count more", "valid", 2.0)
    ] * 2
    assert all(c.reward_valid and c.reward == c.reward_cells[0].value for g in groups for c in g.completions)


def test_every_outcome_of_get_reward_gets_its_status_never_zero(tok):
    from tests.unit.envs import MoodyEnv

    MoodyEnv.calls = 0
    (g,) = generate(tok, [{"prompt": "go"}], ToolsConfig(environment=MoodyEnv, env_slots=1), group_size=6)
    score_groups([g], [env_spec("MoodyEnv"), RewardConfig(**LETTER)])
    got = [
        (c.reward_cells[0].status, c.reward_cells[0].value, c.reward_cells[0].reason) for c in g.completions
    ]
    assert [s for s, _, _ in got] == ["valid", "invalid", "failed", "invalid", "failed", "failed"]
    assert got[0][1] == 2.5 and all(v is None for _, v, _ in got[1:])
    assert "returned None" in got[1][2] and "non-numeric value 'high'" in got[2][2]
    assert "non-finite" in got[3][2] and got[4][2] == "RuntimeError: no score today" and "bool" in got[5][2]
    # a required reward that is not valid masks the completion: no 0 stands in for it
    assert [c.reward_valid for c in g.completions] == [True] + [False] * 5
    assert g.completions[0].reward == pytest.approx(2.5 + g.completions[0].reward_cells[1].value)
    assert all(c.reward is None for c in g.completions[1:])


def test_a_get_reward_that_hangs_times_out_and_its_instance_is_never_reused(tok):
    from tests.unit.envs import SlowRewardEnv

    SlowRewardEnv.release.clear()
    SlowRewardEnv.made = 0
    try:
        (g,) = generate(tok, [{"prompt": "go"}],
                        ToolsConfig(environment=SlowRewardEnv, env_slots=1, tool_timeout_s=0.2), group_size=2)  # fmt: skip
    finally:
        SlowRewardEnv.release.set()
    score_groups([g], [env_spec("SlowRewardEnv")])
    assert [c.reward_cells[0].status for c in g.completions] == ["timeout", "timeout"]
    assert "get_reward() exceeded 0.2s" in g.completions[0].reward_cells[0].reason
    assert SlowRewardEnv.made == 3  # one slot: each hung instance was replaced, never handed on


def _cfg(**over) -> GRPOConfig:
    return GRPOConfig.model_validate(over)


def test_an_environment_with_get_reward_is_a_reward_of_its_own_as_in_trl():
    counter = {"environment": "grpoflow.examples.envs:CounterEnv"}
    alone = _cfg(tools=counter)
    check_run(alone)  # no `rewards`: the environment's reward replaces the demo's default
    assert [(r.name, r.fn, r.weight) for r in alone.rewards] == [("CounterEnv", ENVIRONMENT_REWARD, 1.0)]
    check_run(alone)  # idempotent: preflight runs in the CLI and again in the flow
    assert len(alone.rewards) == 1
    both = _cfg(tools=counter, rewards=[LETTER])
    check_run(both)  # TRL's rule: the functions and the environment's reward both count
    assert [r.name for r in both.rewards] == ["letter", "CounterEnv"]
    off = _cfg(tools=counter | {"environment_reward": False}, rewards=[LETTER])
    check_run(off)
    assert [r.name for r in off.rewards] == ["letter"]
    with pytest.raises(
        ConfigError, match=r"rewards: the config names no reward, and tools.environment is not scored"
    ):
        check_run(_cfg(tools=counter | {"environment_reward": False}))
    with pytest.raises(
        ConfigError, match=r"rewards: 'CounterEnv' is the name of tools.environment's get_reward"
    ):
        check_run(_cfg(tools=counter, rewards=[{**LETTER, "name": "CounterEnv"}]))
    with pytest.raises(ConfigError, match=r"no reward, and tools.environment has no get_reward\(\)"):
        check_run(_cfg(tools={"environment": "tests.unit.envs:ListEnv"}))


def test_the_dict_form_gives_each_rollout_its_rows_environment_and_only_its_tools(tok):
    envs = {"counter": "grpoflow.examples.envs:CounterEnv", "echo": "tests.unit.envs:EchoEnv"}

    async def script(text, k, seed):
        if "<tool_response>" in text:
            return "done"
        return call("increment", by=1) if "Count" in text else call("echo", text="hi")

    rows = [{"prompt": "Count.", "environment": "counter"}, {"prompt": "Echo.", "environment": "echo"}]
    tools = ToolsConfig(environment=envs, env_slots=2)
    counter, echo = generate(tok, rows, tools, script)
    # the stored prompt shows each rollout only its environment's tools
    assert '"increment"' in counter.prompt and '"echo"' not in counter.prompt
    assert '"echo"' in echo.prompt and '"increment"' not in echo.prompt
    assert "A counter starts at 0" in counter.prompt  # reset()'s note; EchoEnv's reset returns None
    assert [tc.name for c in counter.completions for tc in c.tool_calls] == ["increment"] * 2
    assert [(tc.name, tc.failed) for c in echo.completions for tc in c.tool_calls] == [("echo", False)] * 2
    # two classes with get_reward(): one reward each, named after the class, weight 1 (TRL 1.16's rule);
    # a rollout of the other class has no value in its column, never 0, and is not masked by it
    cfg = _cfg(tools={"environment": envs}, data={"generator": "grpoflow.examples.envs:letters_rows"})
    check_run(cfg)
    assert [(r.name, r.weight) for r in cfg.rewards] == [("CounterEnv", 1.0), ("EchoEnv", 1.0)]
    score_groups([counter, echo], cfg.rewards)
    cells = [
        [(x.name, x.value, x.status, x.reason) for x in c.reward_cells]
        for g in (counter, echo)
        for c in g.completions
    ]
    mine, other = (
        ("CounterEnv", 1.0, "valid", ""),
        ("EchoEnv", None, "invalid", "not this rollout's environment"),
    )
    assert cells[:2] == [[mine, other]] * 2
    mine, other = (
        ("CounterEnv", None, "invalid", "not this rollout's environment"),
        ("EchoEnv", 1.0, "valid", ""),
    )
    assert cells[2:] == [[mine, other]] * 2
    assert [(c.reward, c.reward_valid) for g in (counter, echo) for c in g.completions] == [(1.0, True)] * 4
    metrics = reward_metrics([counter, echo], cfg.rewards)  # each reward's rates over its own rollouts
    assert metrics["reward/CounterEnv/invalid_rate"] == 0.0 and metrics["reward/EchoEnv/mean"] == 1.0


def test_rows_that_name_no_configured_environment_fail_before_the_first_step_naming_the_row():
    from grpoflow.flows.training.environments import check_environment_rows

    cfg = _cfg(tools={"environment": {"counter": "grpoflow.examples.envs:CounterEnv"}})
    check_environment_rows(cfg, [{"prompt": "a", "environment": "counter"}])
    with pytest.raises(
        ConfigError, match=r"data: row 1 has environment 'chess'; tools.environment names \['counter'\]"
    ):
        check_environment_rows(
            cfg, [{"prompt": "a", "environment": "counter"}, {"prompt": "b", "environment": "chess"}]
        )
    with pytest.raises(ConfigError, match=r"data: row 0 has no 'environment' field"):
        check_environment_rows(cfg, [{"prompt": "a"}])
    # the dict form may mix environments with get_reward() and without (TRL's rule): the others' rollouts
    # have no value in its column, and are scored by the reward functions alone
    mixed = _cfg(tools={"environment": {"counter": "grpoflow.examples.envs:CounterEnv", "list": "tests.unit.envs:ListEnv"}},
                 rewards=[LETTER])  # fmt: skip
    check_run(mixed)
    assert [(r.name, r.kwargs) for r in mixed.rewards] == [
        ("letter", {}),
        ("CounterEnv", {"environments": ["counter"]}),
    ]


def test_an_environment_that_owns_its_data_gives_the_prompts(tok, tmp_path):
    """No dataset (data.generator: null): run.steps x prompts_per_step rows, each with a `seed` that a
    group's samples share; reset() returns the prompt. One that returns nothing fails loudly."""
    from grpoflow.flows.training.data import load_rows
    from tests.unit.envs import PuzzleEnv

    path = tmp_path / "puzzles.yaml"
    path.write_text(
        "data: {generator: null, prompts_per_step: 2}\nrun: {steps: 3}\n"
        "tools: {environment: 'tests.unit.envs:PuzzleEnv'}\n"
    )
    cfg = load_config(path)  # a config file may leave rewards and rows to its environment
    check_run(cfg)
    assert [r.name for r in cfg.rewards] == ["PuzzleEnv"]
    rows = load_rows(cfg)
    assert len(rows) == 6 and [r["seed"] for r in rows] == list(range(6))
    PuzzleEnv.EMPTY = False
    (g,) = generate(tok, rows[4:5], ToolsConfig(environment=PuzzleEnv, env_slots=1))
    assert "Puzzle 4: what is 4 times 3?" in g.prompt
    assert {c.environment.answer for c in g.completions} == {12}  # one task for the whole group
    PuzzleEnv.EMPTY = True
    try:
        with pytest.raises(ValueError, match=r"PuzzleEnv.reset\(\) returned no prompt"):
            generate(tok, rows[:1], ToolsConfig(environment=PuzzleEnv, env_slots=1))
    finally:
        PuzzleEnv.EMPTY = False
    bare = tmp_path / "bare.yaml"
    bare.write_text(
        "data: {generator: null}\nrewards: [{name: l, fn: 'grpoflow.examples.rewards:letter_fraction'}]\n"
    )
    with pytest.raises(
        ConfigError, match=r"data: the config names no rows .*data.generator: null for an envir"
    ):
        load_config(bare)
    with pytest.raises(
        ValueError, match=r"data: set data.path, data.dataset or data.generator, or tools.environ"
    ):
        GRPOConfig.model_validate({"data": {"generator": None}})


def test_a_nan_from_get_reward_is_invalid_not_zero():
    from grpoflow.tasks.rewards.score import classify

    assert classify(float("nan"))[1] == "invalid" and classify(math.inf)[1] == "invalid"
    assert classify(3)[0:2] == (3.0, "valid")


def test_an_environment_server_that_does_not_answer_or_is_not_allowed_fails_before_the_first_step(
    monkeypatch,
):
    from grpoflow.flows.processes.launch import free_port

    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    with pytest.raises(ConfigError, match=rf"tools.environment: the OpenEnv server at {url} does not answer"):
        check_run(_cfg(tools={"environment": url}))
    both = {"environment": {"board": url, "counter": "grpoflow.examples.envs:CounterEnv"}}
    with pytest.raises(
        ConfigError, match=rf"tools.environment.board: the OpenEnv server at {url} does not answer"
    ):
        check_run(_cfg(tools=both))
    # a worker-started run: only the servers its worker allows, refused before any request
    monkeypatch.setenv("GRPOFLOW_ALLOWED_SERVERS", "http://127.0.0.1:1")
    with pytest.raises(ConfigError, match=rf"tools.environment: '{url}' is not in GRPOFLOW_ALLOWED_SERVERS"):
        check_run(_cfg(tools={"environment": url}))

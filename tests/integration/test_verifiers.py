"""verifiers environments run unchanged (issue 49): the two packages in tests/integration/vf_envs, written as
verifiers' docs describe a taskset, run by verifiers 0.4 itself (its `null` chat-loop harness in a
subprocess, its interception server, its MCP tool servers, its scoring) with every model turn answered by
grpoflow's `PolicyClient`. Two short runs train on the real vLLM server with the tiny model; the tool
calls of the multi-turn environment are driven by the SCRIPTED FAKE backend (tests/unit/scripted.py) on
SmolLM2's real tokenizer, chat template and tool-call format, so nothing depends on what a model samples."""

from __future__ import annotations

import json

import pytest

from grpoflow.tasks.config.rollouts import ToolsConfig
from tests.support import REPO
from tests.unit.scripted import scripted_groups, tool_call

pytestmark = pytest.mark.integration
ENVS = REPO / "tests" / "integration" / "vf_envs"


@pytest.fixture(autouse=True)
def vf_packages(monkeypatch):
    """Both packages importable, here and in the processes verifiers starts (as `pip install -e` would)."""
    paths = [str(ENVS / "vf_sum"), str(ENVS / "vf_tally")]
    for p in paths:
        monkeypatch.syspath_prepend(p)
    monkeypatch.setenv("PYTHONPATH", ":".join(paths))


def _train(tmp_path, run_id: str, block: dict, *, model: str, server: str, steps: int = 1, template=None):
    from grpoflow.flows.config import load_config
    from grpoflow.flows.training.train import grpo_train

    config = tmp_path / f"{run_id}.yaml"
    config.write_text(f"""
model: {json.dumps({"path": str(model), "chat_template": template and str(template)})}
generation: {{group_size: 2, max_tokens: 8}}
data: {{prompts_per_step: 2}}
tools: {{verifiers: {json.dumps(block)}}}
run: {{steps: {steps}, run_id: {run_id}}}
storage: {{root: {tmp_path}}}
inference: {{url: "{server}", max_model_len: 1024}}
""")
    return grpo_train(config=load_config(config))


def test_a_single_turn_environment_trains_on_the_real_server(
    tmp_path, vllm_server, tiny_model_dir, prefect_api
):
    """Rows from the taskset, the policy's tokens and logprobs, each verifiers reward a cell with its weight,
    a None reward masked (never 0), verifiers' metric in `steps`. A plugged reward of keyed scores
    (`manners` -> `polite`, `brief`) is one reward per key, as verifiers records them: named by the key,
    with the function's weight, every cell valid."""
    from grpoflow.storage.sql import query

    manners = {"fn": "vf_sum.taskset:manners", "weight": 0.25}
    block = {"taskset": {"id": "vf_sum", "num_tasks": 4, "task": {"rewards": {"manners": manners}}}}
    out = _train(tmp_path, "vfsum", block, model=tiny_model_dir, server=vllm_server.url, steps=2)
    assert out["steps_trained"] == 2
    _, rows = query(
        tmp_path,
        "SELECT row_id, prompt, len(prompt_ids), len(completion_ids), len(logprobs), num_turns, "
        "list_min(completion_mask), -list_sum(logprobs) FROM rollouts "
        "WHERE split = 'train' ORDER BY step, group_id, sample_index",
    )
    assert len(rows) == 8  # 2 steps x 2 tasks x 2 episodes
    for row_id, prompt, p, c, lp, turns, min_mask, lp_mass in rows:
        assert row_id.startswith("vf-") and "What is" in prompt
        assert p > 0 and c == lp and c > 0 and turns == 1 and min_mask == 1 and lp_mass > 0
    _, cells = query(
        tmp_path,
        "SELECT r.reward_name, r.weight, r.status, o.prompt LIKE '%What is 0 +%' OR o.prompt LIKE '%What is 2 +%' "
        "AS even, count(*) FROM rewards r JOIN rollouts o USING (run_id, split, step, group_id, sample_index) "
        "WHERE r.split = 'train' GROUP BY ALL ORDER BY ALL",
    )
    # `correct` everywhere; `odd_only` returns None on even tasks: invalid (masked), valid on odd ones
    by = {(name, weight, status, even): n for name, weight, status, even, n in cells}
    keyed = {}
    for (name, weight, status, _), n in by.items():
        if name in ("polite", "brief", "manners"):
            keyed[name, weight, status] = keyed.get((name, weight, status), 0) + n
    assert keyed == {("polite", 0.25, "valid"): 8, ("brief", 0.25, "valid"): 8}  # no cell named `manners`
    by = {k: n for k, n in by.items() if k[0] not in ("polite", "brief")}
    assert set(by) <= {("correct", 1.0, "valid", True), ("correct", 1.0, "valid", False),
                       ("odd_only", 0.5, "invalid", True), ("odd_only", 0.5, "valid", False)}  # fmt: skip
    assert by.get(("odd_only", 0.5, "invalid", True), 0) + by.get(("odd_only", 0.5, "valid", False), 0) == 8
    assert (
        by.get(("odd_only", 0.5, "invalid", True), 0) > 0 and by.get(("correct", 1.0, "valid", True), 0) > 0
    )
    _, masked = query(
        tmp_path,
        "SELECT bool_or(o.reward_valid) FROM rollouts o JOIN rewards r USING (run_id, split, step, group_id, "
        "sample_index) WHERE r.reward_name = 'odd_only' AND r.status = 'invalid'",
    )
    assert masked == [(False,)]  # its completions are out of the baseline and the loss
    _, steps = query(tmp_path, 'SELECT "vf/reply_chars", "vf/failed_frac" FROM steps ORDER BY step')
    assert len(steps) == 2 and all(chars is not None and failed == 0.0 for chars, failed in steps)
    # the keys' scores are in each valid completion's total, by their weight
    _, totals = query(
        tmp_path,
        "SELECT any_value(o.reward), sum(r.weight * r.value) FROM rollouts o JOIN rewards r USING (run_id, split, "
        "step, group_id, sample_index) WHERE o.reward_valid GROUP BY step, group_id, sample_index",
    )
    assert totals and all(total == pytest.approx(expected) for total, expected in totals)


def test_a_multi_turn_environment_trains_on_the_real_server_with_smollm2s_template(
    tmp_path, vllm_server, tiny_model_dir, prefect_api, smollm2
):
    """The environment's own `Env.run` adds a user turn after the model's answer: every rollout has two
    model turns in one token sequence, the user's turn between them untrained (mask 0); the prompt is
    rendered with SmolLM2's chat template (`model.chat_template`), its MCP tool in the system turn."""
    from grpoflow.storage.sql import query

    template = tmp_path / "smollm2.jinja"
    template.write_text(smollm2.chat_template)
    block = {"taskset": {"id": "vf_tally", "num_tasks": 2}}
    out = _train(tmp_path, "vftally", block, model=tiny_model_dir, server=vllm_server.url, template=template)
    assert out["steps_trained"] == 1
    _, rows = query(
        tmp_path,
        "SELECT num_turns, list_min(completion_mask), [m.role FOR m IN messages], [m.content FOR m IN messages], "
        "prompt FROM rollouts",
    )
    assert len(rows) == 4
    for turns, min_mask, roles, contents, prompt in rows:
        assert turns >= 2 and min_mask == 0 and "user" in roles
        assert "Thanks. Now reply with the word done." in contents
        assert prompt.startswith("<|im_start|>system") and "tally_toolset_tally" in prompt
        assert prompt.endswith("<|im_start|>assistant\n")
    _, cells = query(tmp_path, "SELECT DISTINCT reward_name FROM rewards ORDER BY 1")
    assert cells == [("called_tally",), ("said_done",)]


@pytest.fixture(scope="module")
def smollm2(smollm2_tokenizer_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_tokenizer_dir)


def test_tool_calls_with_smollm2s_template_are_one_sequence_with_the_results_masked(smollm2):
    """SmolLM2's template and Hermes tool calls: the model calls the environment's MCP tool, answers, then
    answers the environment's follow-up. The rollout is the prompt rendered as grpoflow renders its own
    (tools in the system turn), the model's tokens as sampled (mask 1) and the tool result, user turn and
    template glue between them (mask 0); the call is a `tool_calls` record; verifiers' rewards are cells."""
    from grpoflow.tasks.rewards.vf_reward import cell_of
    from grpoflow.tasks.rollouts.verifiers_env import task_rows

    block = {"taskset": {"id": "vf_tally", "num_tasks": 1}}
    said = {0: tool_call("tally_toolset_tally", n=2), 1: "Two marks.", 2: "done"}

    async def script(text, k, seed):
        return said[text.count("<|im_start|>assistant") - 1]

    (group,) = scripted_groups(
        smollm2, script, task_rows(block, 1), ToolsConfig(verifiers=block), max_turns=5
    )
    for c in group.completions:
        assert [(t.name, t.arguments, t.result, t.failed) for t in c.tool_calls] == [
            ("tally_toolset_tally", '{"n": 2}', "||", False)
        ]
        assert [(m.role, m.content, m.is_completion) for m in c.messages] == [
            ("assistant", said[0], True), ("tool", "||", False), ("assistant", "Two marks.", True),
            ("user", "Thanks. Now reply with the word done.", False), ("assistant", "done", True),
        ]  # fmt: skip
        assert "tally_toolset_tally" in c.prompt and c.prompt.startswith("<|im_start|>system")
        assert c.prompt_ids == smollm2.encode(c.prompt, add_special_tokens=False)
        # the model's tokens are exactly what it said (with its EOS), in order; nothing else is trained
        trained = [t for t, m in zip(c.completion_ids, c.completion_mask, strict=True) if m]
        assert smollm2.decode(trained) == "".join(f"{said[i]}<|im_end|>" for i in range(3))
        assert [lp for lp, m in zip(c.logprobs, c.completion_mask, strict=True) if not m] == [0.0] * (
            len(c.completion_mask) - len(trained)
        )
        untrained = smollm2.decode(
            [t for t, m in zip(c.completion_ids, c.completion_mask, strict=True) if not m]
        )
        assert "||" in untrained and "Thanks. Now reply with the word done." in untrained
        assert [cell_of(c.verifiers, n)[:2] for n in ("called_tally", "said_done")] == [
            (1.0, "valid"),
            (1.0, "valid"),
        ]


def test_an_environment_failing_every_episode_stops_the_run(
    tmp_path, vllm_server, tiny_model_dir, prefect_api
):
    """Every episode's setup raises: every cell `failed` with verifiers' error, and the run stops loudly
    after `run.max_failed_reward_steps` (2) such steps (the broken-reward rule), never trained on a 0."""
    from grpoflow.storage.sql import query
    from grpoflow.tasks.rewards.broken_rewards import BrokenRewardError

    block = {"taskset": {"id": "vf_sum", "num_tasks": 2, "task": {"explode": True}}}
    with pytest.raises(BrokenRewardError, match="correct"):
        _train(tmp_path, "vfboom", block, model=tiny_model_dir, server=vllm_server.url, steps=3)
    _, cells = query(
        tmp_path, "SELECT status, bool_and(reason LIKE '%explode is set%'), count(*) FROM rewards GROUP BY 1"
    )
    assert cells == [("failed", True, 16)]  # two steps (run.max_failed_reward_steps) x 4 episodes x 2 rewards


def test_a_hung_episode_fails_its_cells_at_the_deadline_and_the_others_score(smollm2):
    """One task's episodes hang (in its setup): at `timeout.episode` they fail (cells `failed`, naming the
    deadline), the other task's episodes are scored, and no process of the hung ones is left."""
    import os

    import psutil

    from grpoflow.tasks.rewards.vf_reward import cell_of
    from grpoflow.tasks.rollouts.verifiers_env import task_rows

    # The deadline covers a whole episode, its harness subprocess's start included: a cold batch of four
    # good episodes took 15 s here on a quiet machine (3 s failed good episodes, also alone). The hung
    # ones wait on nothing but the deadline, so a wide one costs this test its length and nothing else.
    block = {
        "taskset": {"id": "vf_sum", "num_tasks": 2, "task": {"hang_on": [0]}},
        "timeout": {"episode": 30},
    }

    async def script(text, k, seed):
        return "3"  # task 1's sum (1 + 2)

    before = {p.pid for p in psutil.Process(os.getpid()).children(recursive=True)}
    g0, g1 = scripted_groups(smollm2, script, task_rows(block, 2), ToolsConfig(verifiers=block))
    for c in g0.completions:
        value, status, reason = cell_of(c.verifiers, "correct")
        assert (value, status) == (None, "failed") and "deadline" in reason, reason
        assert c.completion_ids == [] and c.truncation_reason == "no_model_turn"
    assert [cell_of(c.verifiers, "correct")[:2] for c in g1.completions] == [(1.0, "valid")] * 2
    left = {p.pid for p in psutil.Process(os.getpid()).children(recursive=True)} - before
    assert not left, f"processes left behind: {left}"


def test_an_episode_with_no_model_turn_shows_its_groups_prompt(smollm2):
    """One episode of each group fails before the model is asked: it shows the conversation its group's
    other episode was asked, templated (harness system turn and all), not the row's bare prompt."""
    import uuid

    from grpoflow.tasks.rollouts.verifiers_env import task_rows

    block = {"taskset": {"id": "vf_sum", "num_tasks": 2, "task": {"explode_first": uuid.uuid4().hex}}}

    async def script(text, k, seed):
        return "3"

    for g in scripted_groups(smollm2, script, task_rows(block, 2), ToolsConfig(verifiers=block)):
        silent, asked = sorted(g.completions, key=lambda c: c.truncation_reason != "no_model_turn")
        assert silent.truncation_reason == "no_model_turn" and asked.truncation_reason != "no_model_turn"
        assert asked.prompt.startswith("<|im_start|>") and "What is" in asked.prompt
        assert (silent.prompt, silent.prompt_ids) == (asked.prompt, asked.prompt_ids)


KILLED_CHILD = """
import asyncio, sys
from transformers import AutoTokenizer
from grpoflow.tasks.config.rollouts import ToolsConfig
from grpoflow.tasks.rollouts.verifiers_env import task_rows
from tests.unit.scripted import scripted_groups, tool_call

tok = AutoTokenizer.from_pretrained(sys.argv[1])
block = {"taskset": {"id": "vf_tally", "num_tasks": 1}}


async def script(text, k, seed):
    if text.count("<|im_start|>assistant") == 1:
        return tool_call("tally_toolset_tally", n=2)
    print("mid-episode", flush=True)  # the harness and the tool server are up
    await asyncio.sleep(3600)


scripted_groups(tok, script, task_rows(block, 1), ToolsConfig(verifiers=block), group_size=1)
"""


def test_a_run_killed_mid_episode_leaves_no_process_of_verifiers_behind(smollm2_tokenizer_dir):
    """verifiers starts its harness programs and tool servers in sessions of their own, which outlive a
    parent killed with SIGKILL; grpoflow's watchdog kills every process that carries the run's mark."""
    import os
    import subprocess
    import sys
    import time

    child = subprocess.Popen(
        [sys.executable, "-c", KILLED_CHILD, str(smollm2_tokenizer_dir)],
        cwd=REPO,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert child.stdout.readline().strip() == "mid-episode"
        mark = f"GRPOFLOW_VF_OWNER={child.pid}".encode()

        def marked() -> list[int]:
            out = []
            for pid in (int(d) for d in os.listdir("/proc") if d.isdigit()):
                try:
                    with open(f"/proc/{pid}/environ", "rb") as f:
                        if mark in f.read().split(b"\0") and pid != child.pid:
                            out.append(pid)
                except OSError:
                    continue
            return out

        assert len(marked()) >= 2  # the harness program and the tool server (and the watchdog's shell gone)
        child.kill()
        child.wait(10)
        deadline = time.monotonic() + 10
        while marked() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert marked() == []
    finally:
        child.kill()

"""Reward functions written for TRL's GRPOTrainer: completions in TRL's form on request, TRL's keywords
(trainer_state, log_extra, log_metric) and where what they log lands; a reward that fails on every
completion is named with its traceback and, in TRL's form, told how to fix it."""

from __future__ import annotations

import pytest

from grpoflow.storage.records import RewardCell, TaggedMessage, ToolCallRecord
from grpoflow.storage.rollouts import RolloutStore
from grpoflow.storage.sql import query
from grpoflow.tasks.config.rewards import RewardConfig
from grpoflow.tasks.rewards.broken_rewards import broken_rewards
from grpoflow.tasks.rewards.reward_kwargs import TrainerState, completion_messages
from grpoflow.tasks.rewards.score import score_groups
from tests.support import make_groups

pytestmark = pytest.mark.unit

SYSTEM = {"role": "system", "content": "Answer in \\boxed{}."}


def conversational_groups(n_groups: int = 2, size: int = 2):
    """make_groups with TRL-style conversational rows: a system + user prompt, a `solution` column."""
    groups = make_groups(n_groups, size)
    for g in groups:
        g.row = {"prompt": [SYSTEM, {"role": "user", "content": f"1/{g.prompt_index + 3}?"}],
                 "solution": f"$\\frac{{1}}{{{g.prompt_index + 3}}}$"}  # fmt: skip
        for c in g.completions:
            c.messages = [TaggedMessage("assistant", c.completion, True)]
    return groups


def test_messages_form_gives_conversational_completions_as_trl_does():
    seen = {}

    def trl_style(prompts, completions, **kw):  # as TRL's documentation writes them
        seen.update(prompts=prompts, completions=completions)
        return [float(len(c[0]["content"])) for c in completions]

    groups = conversational_groups()
    score_groups(groups, [RewardConfig(name="r", fn=trl_style, completions="messages")])
    assert (
        seen["completions"]
        == [[{"role": "assistant", "content": "a"}], [{"role": "assistant", "content": "aa"}]] * 2
    )
    assert seen["prompts"][0] == groups[0].row["prompt"] and seen["prompts"][2] == groups[1].row["prompt"]
    assert all(c.reward_cells[0].status == "valid" for g in groups for c in g.completions)
    # text (the default) keeps today's form: the completion's text
    score_groups(
        groups,
        [RewardConfig(name="r", fn=lambda completions, **_: [seen.update(text=completions)] and [0.0] * 4)],
    )
    assert seen["text"] == ["a", "aa", "a", "aa"]


def test_plain_text_prompts_stay_text_in_messages_form():
    seen = {}
    groups = make_groups(1, 2)  # prompts are strings
    score_groups(groups, [RewardConfig(name="r", completions="messages",
                                       fn=lambda completions, **_: [seen.update(c=completions)] and [1.0, 1.0])])  # fmt: skip
    assert seen["c"] == ["a", "aa"]


def test_a_tool_rollout_is_every_message_after_the_prompt_with_its_tool_calls():
    c = make_groups(1, 1)[0].completions[0]
    c.messages = [
        TaggedMessage("assistant", '<tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>', True),
        TaggedMessage("tool", "2"),
        TaggedMessage("tool", "oops"),
        TaggedMessage("assistant", "It is 2.", True),
    ]
    c.tool_calls = [
        ToolCallRecord(0, "add", '{"a": 1}', "2"),
        ToolCallRecord(0, "mul", "not json", "oops", True),
    ]
    msgs = completion_messages(c)
    assert [m["role"] for m in msgs] == ["assistant", "tool", "tool", "assistant"]
    assert msgs[0]["tool_calls"] == [
        {"type": "function", "function": {"name": "add", "arguments": {"a": 1}}},
        {"type": "function", "function": {"name": "mul", "arguments": "not json"}},
    ]
    assert msgs[1] == {"role": "tool", "content": "2", "name": "add"} and msgs[2]["name"] == "mul"
    assert "tool_calls" not in msgs[3] and msgs[3]["content"] == "It is 2."


def test_trls_own_reward_functions_score_every_cell():
    trl_rewards = pytest.importorskip("trl.rewards")
    pytest.importorskip("math_verify")
    groups = conversational_groups(2, 2)
    right, wrong = groups[0].completions
    right.messages = [TaggedMessage("assistant", "<think>easy</think>\nThe answer is $\\frac{1}{3}$", True)]
    wrong.messages = [TaggedMessage("assistant", "The answer is $\\frac{1}{2}$", True)]
    specs = [
        RewardConfig(name="accuracy", fn="trl.rewards:accuracy_reward", completions="messages"),
        RewardConfig(name="think", fn="trl.rewards:think_format_reward", completions="messages"),
    ]
    assert trl_rewards.accuracy_reward and score_groups(groups, specs)["reward/valid_frac"] == 1.0
    acc = {c.sample_index: c.reward_cells[0] for c in groups[0].completions}
    think = {c.sample_index: c.reward_cells[1] for c in groups[0].completions}
    assert (acc[0].value, acc[1].value, think[0].value, think[1].value) == (1.0, 0.0, 1.0, 0.0)
    assert acc[0].extra["solution"] == "$\\frac{1}{3}$" and "gold_parsed" in acc[0].extra  # its log_extra


def test_trainer_state_log_extra_and_log_metric_land_in_cells_and_metrics(tmp_path):
    seen = {}

    def logs(completions, trainer_state, log_extra, log_metric, **_):
        seen["state"] = trainer_state
        log_extra("chars", [len(c) for c in completions])
        log_metric("hits", 1.0)
        log_metric("hits", 3.0)  # several calls average, as TRL's do
        return [1.0] * len(completions)

    groups = make_groups(2, 2)
    state = TrainerState(global_step=7, epoch=1.5, max_steps=20)
    metrics = score_groups(groups, [RewardConfig(name="lg", fn=logs)], state)
    assert seen["state"] is state and metrics["reward/lg/hits"] == 2.0
    assert [c.reward_cells[0].extra for c in groups[0].completions] == [{"chars": 1}, {"chars": 2}]
    store = RolloutStore(tmp_path)
    store.write_rewards("r", 7, groups)
    store.write_step("r", 7, metrics)
    _, rows = query(
        tmp_path, "SELECT sample_index, extra->>'chars' FROM rewards WHERE group_id = 'g1' ORDER BY 1"
    )
    assert rows == [(0, "1"), (1, "2")]
    _, rows = query(tmp_path, 'SELECT "reward/lg/hits" FROM steps')
    assert rows == [(2.0,)]


def test_what_a_pool_process_logs_comes_back():
    groups = make_groups(1, 3)
    spec = RewardConfig(name="p", fn="tests.unit.reward_fns:logs_lengths", executor="process", timeout_s=60)
    metrics = score_groups(groups, [spec], TrainerState(4, 0.0, 10))
    assert [c.reward_cells[0].extra for c in groups[0].completions] == [
        {"length": n} for n in (1.0, 2.0, 3.0)
    ]
    assert metrics["reward/p/total"] == 6.0 and metrics["reward/p/step_seen"] == 4.0


@pytest.mark.parametrize(
    ("call", "reason"),
    [
        (
            lambda log_extra, **_: log_extra("x", [1]),
            "log_extra('x'): expected 2 values, one per completion, got 1 values",
        ),
        (lambda log_metric, **_: log_metric("mean", 1.0), "log_metric('mean'): the name is grpoflow's own"),
        (
            lambda log_metric, **_: log_metric("m", "high"),
            "log_metric('m'): expected a finite number, got 'high'",
        ),
    ],
)
def test_bad_log_calls_fail_the_cells_saying_why(call, reason):
    groups = make_groups(1, 2)
    score_groups(groups, [RewardConfig(name="b", fn=lambda **kw: call(**kw) or [1.0, 1.0])])
    cell = groups[0].completions[0].reward_cells[0]
    assert cell.status == "failed" and reason in cell.reason


def docs_style(completions, **kwargs):
    return [float(len(c[0]["content"])) for c in completions]


def test_a_reward_failing_everywhere_is_named_with_its_traceback_and_the_format_hint():
    groups = conversational_groups()
    specs = [RewardConfig(name="ok", fn=lambda completions, **_: [1.0] * len(completions)),
             RewardConfig(name="docs", fn=docs_style)]  # fmt: skip
    score_groups(groups, specs)
    [broken] = broken_rewards(groups, specs)
    assert (broken.name, broken.index, broken.failed, broken.total) == ("docs", 1, 4, 4)
    assert broken.reason.startswith("TypeError: string indices must be integers")
    assert "Traceback" in broken.trace and "docs_style" in broken.trace
    assert "set rewards[1].completions: messages" in broken.hint and broken.hint in broken.line()
    # the same failure on plain-text prompts: no hint (the completions' form is not the cause)
    plain = make_groups(2, 2)
    score_groups(plain, specs)
    [broken] = broken_rewards(plain, specs)
    assert broken.hint is None and "4/4" in broken.line()


def test_a_partial_failure_is_data_not_a_broken_reward():
    groups = make_groups(1, 3)
    spec = RewardConfig(
        name="some", fn=lambda completions, **_: ["x" if len(c) == 1 else 1.0 for c in completions]
    )
    score_groups(groups, [spec])
    assert [c.reward_cells[0].status for c in groups[0].completions] == ["failed", "valid", "valid"]
    assert broken_rewards(groups, [spec]) == []


def test_timeouts_on_every_completion_are_a_broken_reward_too():
    groups = make_groups(1, 2)
    for i, c in enumerate(groups[0].completions):
        c.reward_cells = [
            RewardCell("x", 1.0 if i else None, "valid" if i else "timeout", "" if i else "exceeded 1s")
        ]
    assert broken_rewards(groups, [RewardConfig(name="x", fn=len)]) == []
    groups[0].completions[1].reward_cells = [RewardCell("x", None, "timeout", "exceeded 1s")]
    assert broken_rewards(groups, [RewardConfig(name="x", fn=len)])[0].reason == "exceeded 1s"


def _watched(limit: int):
    from grpoflow.flows.config import GRPOConfig
    from grpoflow.flows.training.step_close import RewardWatch

    specs = [RewardConfig(name="ok", fn=lambda completions, **_: [1.0] * len(completions)),
             RewardConfig(name="docs", fn=docs_style)]  # fmt: skip
    cfg = GRPOConfig(rewards=specs, run={"max_failed_reward_steps": limit})
    return RewardWatch(cfg, "my-run"), specs


def _scored(specs, fail: bool):
    groups = conversational_groups() if fail else make_groups(2, 2)
    if not fail:
        for g in groups:
            for c in g.completions:
                c.messages = [TaggedMessage("assistant", c.completion, True)]
    scored = specs if fail else [specs[0], RewardConfig(name="docs", fn=lambda completions, **_: [0.0] * 4)]
    score_groups(groups, scored)
    return broken_rewards(groups, scored)  # what the step's batch carries


def test_a_required_reward_broken_for_max_failed_reward_steps_stops_the_run_in_one_line():
    from grpoflow.tasks.rewards.broken_rewards import BrokenRewardError

    watch, specs = _watched(2)
    assert watch.step(0, _scored(specs, fail=True)) is None  # one broken step: logged, not yet stopped
    assert watch.step(1, _scored(specs, fail=False)) is None  # it recovered: the streak starts over
    assert watch.step(2, _scored(specs, fail=True)) is None
    stop = watch.step(3, _scored(specs, fail=True))
    assert isinstance(stop, BrokenRewardError)
    msg = str(stop)
    assert "\n" not in msg and msg.startswith("reward 'docs' failed on every completion of steps 2-3")
    assert (
        "TypeError: string indices must be integers" in msg and "set rewards[1].completions: messages" in msg
    )
    assert msg.endswith("--resume my-run")


def test_max_failed_reward_steps_0_never_stops_and_an_optional_reward_never_does():
    watch, specs = _watched(0)
    assert all(watch.step(step, _scored(specs, fail=True)) is None for step in range(4))
    watch, specs = _watched(1)
    specs[1].required = False
    watch.cfg.rewards[1].required = False
    assert watch.step(0, _scored(specs, fail=True)) is None


def test_the_step_line_says_nothing_trained_and_which_rewards_failed():
    from types import SimpleNamespace

    from grpoflow.flows.config import GRPOConfig
    from grpoflow.flows.training.progress import StepReporter

    cfg = GRPOConfig(rewards=[RewardConfig(name="acc", fn="grpoflow.examples.rewards:letter_fraction"),
                              RewardConfig(name="fmt", fn="grpoflow.examples.rewards:letter_fraction")])  # fmt: skip
    me = SimpleNamespace(cfg=cfg)
    broken = {"reward/mean": None, "train/samples": 0.0, "reward/acc/failed_rate": 0.75, "reward/acc/timeout_rate": 0.25,
              "reward/fmt/failed_rate": 0.0, "reward/fmt/mean": 0.5, "reward/fmt/hits": 3.0, "wall_seconds": 2.0}  # fmt: skip
    assert (
        StepReporter.line(me, broken)
        == "reward n/a  nothing trained  failed: acc 100%  fmt/hits 3  2.0s/step"
    )
    fine = {"reward/mean": 0.5, "train/samples": 8.0, "train/loss": 0.125, "wall_seconds": 1.0}
    assert StepReporter.line(me, fine) == "reward 0.500  loss 0.1250  1.0s/step"


def test_a_failed_batch_keeps_each_completions_own_logged_columns():
    def short(completions, log_extra, **_):
        log_extra("i", list(range(len(completions))))
        return [1.0]  # the wrong number of values: every cell fails

    groups = make_groups(1, 3)
    score_groups(groups, [RewardConfig(name="s", fn=short)])
    cells = [c.reward_cells[0] for c in groups[0].completions]
    assert all(x.status == "failed" for x in cells)
    assert [x.extra for x in cells] == [{"i": 0}, {"i": 1}, {"i": 2}]


def test_a_run_whose_every_completion_is_masked_stops_after_max_failed_reward_steps_in_one_line():
    """Invalid cells on every completion (a reward with no value for any: the shape of a verifiers
    reward recorded under other names) train nothing: not a broken reward (nothing failed), but the
    same watch stops the run; a step with one valid completion, or with equal rewards, resets it."""
    from grpoflow.flows.config import GRPOConfig
    from grpoflow.flows.training.step_close import RewardWatch
    from grpoflow.tasks.rewards.broken_rewards import BrokenRewardError, masked_batch

    def none(completions, **_):
        return [None] * len(completions)

    def one(completions, **_):
        return [1.0] + [None] * (len(completions) - 1)

    def equal(completions, **_):
        return [0.5] * len(completions)

    specs = [RewardConfig(name="manners", fn=none), RewardConfig(name="length", fn=equal)]
    watch = RewardWatch(GRPOConfig(rewards=specs, run={"max_failed_reward_steps": 2}), "quiet")

    def batch(*fns):
        groups, scored = (
            make_groups(2, 2),
            [RewardConfig(name=s.name, fn=f) for s, f in zip(specs, fns, strict=True)],
        )
        score_groups(groups, scored)
        assert broken_rewards(groups, scored) == []  # nothing failed: not the broken-reward rule
        return masked_batch(groups, scored)

    masked = batch(none, equal)
    assert masked.line() == "every completion (4) was masked: reward 'manners' invalid on 4/4: returned None"
    assert watch.step(0, [], masked) is None  # logged, not yet stopped
    assert batch(one, equal) is None  # one completion counts: the streak starts over
    assert watch.step(1, [], None) is None
    assert batch(equal, equal) is None  # equal rewards: valid, advantages 0, data
    assert watch.step(2, [], batch(none, equal)) is None
    stop = watch.step(3, [], batch(none, equal))
    assert isinstance(stop, BrokenRewardError)
    msg = str(stop)
    assert "\n" not in msg and msg.startswith("every completion of steps 2-3 was masked")
    assert "reward 'manners' invalid on 4/4" in msg and "length" not in msg
    assert msg.endswith("--resume quiet")

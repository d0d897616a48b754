"""`tools.verifiers` before the first step (issue 49): one `error:` line naming the field for what cannot
run, the environment's rewards as reward entries with verifiers' weights, and cells that are never a
silent 0. The environments are the real packages in tests/integration/vf_envs (verifiers 0.4, loaded by
verifiers itself); nothing here starts a server or an episode."""

from __future__ import annotations

import sys

import pytest

from grpoflow.flows.config import ConfigError, GRPOConfig
from grpoflow.flows.training.environments import check_run
from grpoflow.tasks.rewards.vf_reward import VERIFIERS_REWARD, VerifiersOutcome, cell_of, episode_metrics
from tests.support import REPO

ENVS = REPO / "tests" / "integration" / "vf_envs"
SUM = {"taskset": {"id": "vf_sum", "num_tasks": 4}}


@pytest.fixture(autouse=True)
def vf_packages(monkeypatch):
    monkeypatch.syspath_prepend(str(ENVS / "vf_sum"))
    monkeypatch.syspath_prepend(str(ENVS / "vf_tally"))


def _cfg(**over) -> GRPOConfig:
    return GRPOConfig.model_validate({"tools": {"verifiers": SUM}, **over})


def test_its_rewards_become_reward_entries_with_verifiers_weights_and_its_tasks_rows():
    from grpoflow.flows.training.environments import verifiers_rows

    cfg = _cfg()
    check_run(cfg)
    check_run(cfg)  # preflight runs twice for a CLI run: entries added once
    assert [(r.name, r.fn, r.weight) for r in cfg.rewards] == [
        ("correct", VERIFIERS_REWARD, 1.0), ("odd_only", VERIFIERS_REWARD, 0.5)
    ]  # fmt: skip
    assert cfg.generation.max_turns == 10  # a verifiers episode ends itself; grpoflow's cap is generous
    rows = verifiers_rows(cfg)
    assert [r["prompt"] for r in rows] == [f"What is {i} + {i + 1}?" for i in range(4)]
    assert len({r["id"] for r in rows}) == 4 and all(r["id"].startswith("vf-") for r in rows)


def test_rewards_of_the_users_own_join_the_environments():
    cfg = _cfg(rewards=[{"name": "exact", "fn": "grpoflow.examples.rewards:exact_number"}])
    check_run(cfg)
    assert [r.name for r in cfg.rewards] == ["exact", "correct", "odd_only"]


@pytest.mark.parametrize(
    ("over", "message"),
    [
        ({"tools": {"verifiers": {"taskset": {}}}}, "tools.verifiers.taskset.id: name the taskset"),
        ({"tools": {"verifiers": {"taskset": {"id": "no_such_env_pkg"}}}}, "tools.verifiers: cannot load the environment"),
        ({"tools": {"verifiers": {**SUM, "interception": {"type": "elastic"}}}}, "tools.verifiers.interception"),
        ({"tools": {"verifiers": {"taskset": {"id": "vf_sum", "no_such_field": 1}}}}, "no_such_field"),
        ({"tools": {"verifiers": SUM, "tools": ["grpoflow.examples.tools:calculator"]}}, "remove tools.tools"),
        ({"tools": {"verifiers": SUM}, "data": {"path": "rows.jsonl"}}, "the rows come from its taskset"),
        ({"tools": {"verifiers": SUM}, "rewards": [{"name": "correct", "fn": "grpoflow.examples.rewards:exact_number"}]},
         "rewards: ['correct'] are names of the verifiers environment's rewards"),
    ],
)  # fmt: skip
def test_what_cannot_run_fails_before_the_first_step_naming_the_field(over, message):
    with pytest.raises(ConfigError) as e:
        check_run(GRPOConfig.model_validate(over))
    assert message in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_without_verifiers_the_error_names_the_extra(monkeypatch):
    for name in [m for m in sys.modules if m == "verifiers" or m.startswith("verifiers.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "verifiers", None)  # an import of it fails, as where it is not installed
    with pytest.raises(ConfigError, match=r"pip install 'grpoflow\[verifiers\]'"):
        check_run(_cfg())


def test_a_worker_started_run_imports_allowed_tasksets_only(monkeypatch):
    monkeypatch.setenv("GRPOFLOW_ALLOWED_MODULES", "grpoflow.examples")
    with pytest.raises(ConfigError, match="tools.verifiers.taskset.id: .*'vf_sum' is not in"):
        check_run(_cfg())


def test_cells_are_never_a_silent_zero():
    ok = VerifiersOutcome(scores={"a": 0.0, "b": None, "c": float("nan")})
    assert cell_of(ok, "a") == (0.0, "valid", "")
    assert cell_of(ok, "b")[:2] == (None, "invalid")
    assert cell_of(ok, "c")[:2] == (None, "invalid")
    assert cell_of(ok, "d")[:2] == (None, "invalid")  # verifiers recorded nothing under that name
    assert cell_of(None, "a")[:2] == (None, "failed")
    broken = VerifiersOutcome(scores={"a": 1.0}, error="HarnessError: exited 1")
    assert cell_of(broken, "a") == (None, "failed", "the episode failed: HarnessError: exited 1")
    scoring = VerifiersOutcome(scores={"a": None}, scoring_error="TaskError: task T scoring: KeyError: 'x'")
    assert cell_of(scoring, "a")[:2] == (None, "failed")
    assert episode_metrics([ok, broken]) == {"vf/failed_frac": 0.5}
    assert episode_metrics([VerifiersOutcome(metrics={"m": 1.0}), VerifiersOutcome(metrics={"m": 3.0})]) == {
        "vf/failed_frac": 0.0, "vf/m": 2.0
    }  # fmt: skip


def test_a_reward_of_keyed_scores_becomes_one_entry_per_key_once_an_episode_shows_them():
    """verifiers declares `manners`, records `polite` and `brief` (the function's weight) and drops the
    `manners` seed; an episode whose scoring stopped first still has the seed (None). `odd_only` failing
    on every episode of the batch keeps its entry."""
    from grpoflow.storage.records import RolloutCompletion, RolloutGroup
    from grpoflow.tasks.config.rewards import RewardConfig
    from grpoflow.tasks.rewards.vf_reward import keyed_rewards

    def group(*outcomes):
        comps = [RolloutCompletion(i, "", [1], [1], [0.0]) for i in range(len(outcomes))]
        for c, o in zip(comps, outcomes, strict=True):
            c.verifiers = o
        return RolloutGroup("g", 0, "p", [0], comps)

    specs = [RewardConfig(name=n, fn=VERIFIERS_REWARD, weight=w) for n, w in
             (("correct", 1.0), ("manners", 0.25), ("odd_only", 0.5))] + [RewardConfig(name="mine", fn=len)]  # fmt: skip
    keyed = VerifiersOutcome(scores={"correct": 1.0, "polite": 0.0, "brief": 0.5, "odd_only": None},
                             weights={"correct": 1.0, "polite": 0.25, "brief": 0.25})  # fmt: skip
    stopped = VerifiersOutcome(scores={"correct": 1.0, "manners": None, "odd_only": None},
                               scoring_error="TaskError: task T scoring: ValueError: x")  # fmt: skip
    assert keyed_rewards(specs, [group(stopped)]) is None  # no keys seen yet: nothing to know them by
    new, became = keyed_rewards(specs, [group(stopped, keyed, VerifiersOutcome(error="HarnessError: x"))])
    assert [(s.name, s.weight, s.fn) for s in new] == [
        ("correct", 1.0, VERIFIERS_REWARD), ("polite", 0.25, VERIFIERS_REWARD), ("brief", 0.25, VERIFIERS_REWARD),
        ("odd_only", 0.5, VERIFIERS_REWARD), ("mine", 1.0, len),
    ]  # fmt: skip
    assert became == {"manners": ["polite", "brief"]}
    assert keyed_rewards(new, [group(keyed)]) is None  # known now: the next batches keep them
    # the episode whose scoring stopped before the keys: failed with verifiers' error, not "no reward"
    assert cell_of(stopped, "polite") == (
        None,
        "failed",
        "verifiers' scoring failed: TaskError: task T scoring: ValueError: x",
    )

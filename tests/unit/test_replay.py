"""grpo-replay's config: the replay's sections that made the samples must be the source run's; the rest
(algorithm, learner) is the replay's own. The replay itself runs in tests/integration/test_reproducibility.py."""

from __future__ import annotations

import pytest

from grpoflow.flows.config import ConfigError, load_config
from grpoflow.flows.lineage.replay import replay_config

pytestmark = pytest.mark.unit


def test_a_replay_keeps_the_source_runs_store_and_takes_its_own_algorithm():
    source = load_config(None, ["storage.root=/store", "run.run_id=r1", "algorithm.loss_type=grpo"])
    other = load_config(None, ["storage.root=/elsewhere", "algorithm.loss_type=dr_grpo", "learner.lr=0.5"])
    cfg = replay_config(source, other, "r1-b", "r1")
    assert (cfg.storage.root, cfg.run.run_id) == ("/store", "r1-b")
    assert (cfg.algorithm.loss_type, cfg.learner.lr) == ("dr_grpo", 0.5)
    assert replay_config(source, None, "r1-c", "r1").algorithm.loss_type == "grpo"  # the run's own


@pytest.mark.parametrize(
    "field, value",
    [
        ("generation.temperature", 0.5),
        ("data.prompts_per_step", 3),
        ("model.path", "other"),
        ("tools.environment_reward", False),
    ],
)
def test_a_replay_that_changes_what_made_the_samples_is_refused_naming_the_field(field, value):
    source = load_config(None, ["run.run_id=r1"])
    with pytest.raises(ConfigError, match=rf"^{field}: the replay's {value!r} is not run r1's"):
        replay_config(source, load_config(None, [f"{field}={value}"]), "r1-b", "r1")


def test_overrides_apply_to_a_recorded_config_tree():
    recorded = load_config(None, ["generation.temperature=0.7", "run.steps=4"]).model_dump(mode="json")
    cfg = load_config(None, ["algorithm.loss_type=dapo"], base=recorded)
    assert (cfg.generation.temperature, cfg.run.steps, cfg.algorithm.loss_type) == (0.7, 4, "dapo")
    assert recorded["algorithm"]["loss_type"] != "dapo"  # the recorded tree itself is left as it was


def test_bad_input_is_refused_before_a_flow_run_starts(tmp_path):
    from grpoflow.flows.lineage.replay import plan
    from grpoflow.storage.records import RolloutCompletion, RolloutGroup
    from grpoflow.storage.rollouts import RolloutStore
    from grpoflow.storage.sql import QueryError

    rs = RolloutStore(tmp_path)
    source = load_config(None, ["run.run_id=r1", "run.steps=2"])
    rs.write_run_meta("r1", {"run_id": "r1", "config": source.model_dump(mode="json")})
    rs.write_run_meta("other", {"run_id": "other", "config": source.model_dump(mode="json")})
    for step in (0, 1):
        rs.write_rollouts(
            "r1",
            step,
            [RolloutGroup(f"g{step}", step, "p", [1], [RolloutCompletion(0, "c", [2], [1], [-1.0])])],
        )
    cfg, _ = plan("r1", root=str(tmp_path), sets=["algorithm.loss_type=dapo"], where="prompt_index = 0")
    assert (cfg.run.run_id, cfg.algorithm.loss_type, cfg.storage.root) == ("r1-replay", "dapo", str(tmp_path))
    for kwargs, error, match in (
        ({"run": "nope"}, ConfigError, "RUN: no run 'nope'"),
        ({"run": "r1", "sets": ["run.steps=3"]}, ConfigError, "run.steps: 3 steps, and run r1 stored 2"),
        ({"run": "r1", "where": "no_such_column = 1"}, QueryError, "no_such_column"),
        ({"run": "r1", "replay_id": "other"}, ConfigError, "--run-id: run 'other' already exists"),
        ({"run": "r1", "resume": "other"}, ConfigError, "--resume: run 'other' is not a replay of r1"),
        ({"run": "r1", "resume": "r1-b"}, ConfigError, "--resume: no replay 'r1-b'"),
    ):
        with pytest.raises(error, match=match):
            plan(**kwargs, root=str(tmp_path))

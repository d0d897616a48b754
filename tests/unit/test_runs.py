"""Run bookkeeping: the data cursor, dataset validation, model checks, stale-group accounting."""

from __future__ import annotations

import json

import pytest

from grpoflow.flows.config import ConfigError, load_config
from grpoflow.flows.training.data import load_rows, rows_for_step
from grpoflow.flows.training.runs import open_run, prepare_model
from grpoflow.storage.records import RolloutCompletion, RolloutGroup
from grpoflow.tasks.advantages import assign_advantages
from grpoflow.tasks.config.algorithm import AlgorithmConfig

pytestmark = pytest.mark.unit


def test_cursor_is_a_function_of_the_step_and_covers_each_epoch_once():
    rows = [{"prompt": f"p{i}"} for i in range(10)]
    seen = []
    for step in range(5):  # 5 steps x 4 = 20 rows = two epochs
        batch, cursor = rows_for_step(rows, step, 4, seed=3, shuffle=True)
        assert cursor == list(range(step * 4, step * 4 + 4))
        assert rows_for_step(rows, step, 4, seed=3, shuffle=True)[0] == batch  # resumable: same again
        seen += [r["prompt"] for r in batch]
    assert sorted(seen[:10]) == sorted(r["prompt"] for r in rows)  # epoch 0 is a permutation
    assert sorted(seen[10:]) == sorted(r["prompt"] for r in rows)  # so is epoch 1
    assert seen[:10] != seen[10:]  # reshuffled per epoch
    unshuffled, _ = rows_for_step(rows, 0, 4, seed=3, shuffle=False)
    assert [r["prompt"] for r in unshuffled] == ["p0", "p1", "p2", "p3"]


def test_dataset_row_without_prompt_is_named(tmp_path):
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"prompt": "ok"}) + "\n" + json.dumps({"question": "no prompt"}) + "\n")
    cfg = load_config(None, [f"data.path={data}"])
    with pytest.raises(ConfigError, match="row 1 has no 'prompt'"):
        load_rows(cfg)


def test_empty_dataset_and_missing_file(tmp_path):
    empty = tmp_path / "e.jsonl"
    empty.write_text("\n")
    with pytest.raises(ConfigError, match="empty"):
        load_rows(load_config(None, [f"data.path={empty}"]))
    with pytest.raises(ConfigError, match="data.path"):
        load_rows(load_config(None, [f"data.path={tmp_path / 'missing.jsonl'}"]))


def test_model_dir_without_tokenizer_is_refused(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ConfigError, match="no tokenizer"):
        prepare_model(load_config(None, [f"model.path={tmp_path}"]))
    with pytest.raises(ConfigError, match="not a model directory"):
        prepare_model(load_config(None, [f"model.path={tmp_path / 'nope'}"]))


def test_resume_of_unknown_run_and_escaping_run_id(tmp_path):
    cfg = load_config(None, [f"storage.root={tmp_path}"])
    with pytest.raises(ConfigError, match="no run 'ghost'"):
        open_run(cfg, "ghost", tmp_path)
    with pytest.raises(ValueError, match="invalid run id"):
        open_run(cfg, "../outside", tmp_path)
    assert list(tmp_path.iterdir()) == []  # nothing written


def _group(gid: str, rewards, versions):
    comps = [
        RolloutCompletion(
            sample_index=i,
            completion="x",
            completion_ids=[1],
            completion_mask=[1],
            logprobs=[-1.0],
            policy_version=v,
            policy_version_end=v,
            reward=r,
            reward_valid=r is not None,
            invalid_reason=None if r is not None else "r: invalid",
        )
        for i, (r, v) in enumerate(zip(rewards, versions, strict=True))
    ]
    return RolloutGroup(group_id=gid, prompt_index=0, prompt="p", prompt_ids=[0], completions=comps)


def test_stale_groups_are_dropped_with_a_reason_and_counted():
    fresh = _group("fresh", [1.0, 0.0, None], [4, 4, 4])
    stale = _group("stale", [1.0, 0.0], [2, 3])  # oldest completion is 3 versions behind step 5
    m = assign_advantages([fresh, stale], step=5, algorithm=AlgorithmConfig(max_staleness=2))
    assert m["groups_dropped_stale"] == 1 and m["staleness_max"] == 3
    assert all(not c.trained and c.drop_reason.startswith("stale") for c in stale.completions)
    a, b, invalid = fresh.completions
    assert a.trained and b.trained and a.advantage > 0 > b.advantage
    assert not invalid.trained and invalid.advantage == 0.0 and "reward invalid" in invalid.drop_reason


@pytest.mark.parametrize("max_staleness,sync_every", [(1, 1), (1, 2), (2, 3), (1, 4), (3, 2)])
def test_pushing_every_n_steps_drops_nothing_and_staleness_is_one_number(max_staleness, sync_every):
    """Versions as the loop makes them: the batch of step s is generated when step s - max_staleness
    starts, under the last push (after step t, version t + 1 when (t + 1) % sync_every == 0). No batch
    is dropped by construction, and the check, the metric and the stored column agree."""
    from grpoflow.storage.tables import rollout_rows

    def served_at_start_of(u: int) -> int:
        return max([t + 1 for t in range(u) if (t + 1) % sync_every == 0], default=0)

    lags = []
    for step in range(12):
        v = served_at_start_of(max(0, step - max_staleness))
        g = _group(f"g{step}", [1.0, 0.0], [v, v])
        m = assign_advantages(
            [g], step=step, algorithm=AlgorithmConfig(max_staleness=max_staleness), sync_every=sync_every
        )
        assert m["groups_dropped_stale"] == 0 and all(c.trained for c in g.completions)
        (row, _) = rollout_rows([g], run_id="r", step=step)
        assert row["staleness"] == step - v == m["staleness_max"]
        lags.append(step - v)
    assert max(lags) == max_staleness + sync_every - 1  # the documented bound is reached, not exceeded


def test_on_policy_with_infrequent_pushes_is_refused_naming_both_fields():
    from grpoflow.flows.config import ConfigError, load_config

    with pytest.raises(
        ConfigError, match=r"algorithm.max_staleness 0 .*sync.sync_every 1.*got sync.sync_every 2"
    ):
        load_config(None, ["algorithm.max_staleness=0", "sync.sync_every=2"])
    load_config(None, ["algorithm.max_staleness=1", "sync.sync_every=2"])  # allowed: lag <= 2

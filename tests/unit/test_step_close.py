"""The step's close hook (flows/training/step_close.py): what happens when a step closes, in its order.

The store and the step runner are the real ones (Parquet files read back); the checkpoint unit, the
pipeline, the compactor and the trackers are recording stand-ins (a unit test loads no model and
starts no server), as is the progress reporter (its line goes through a flow run's logger), each
appending what it was asked to an ordered log."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from grpoflow.flows.config import GRPOConfig
from grpoflow.flows.training.runner import StepRunner
from grpoflow.flows.training.runs import RunState
from grpoflow.flows.training.step_close import StepClose, due
from grpoflow.storage.rollouts import RolloutStore
from grpoflow.tasks.rewards.broken_rewards import BrokenReward, BrokenRewardError

pytestmark = pytest.mark.unit


class Log(list):
    def store(self, root: Path):
        """The real store, its step writes logged as ('row', step, has_checkpoint_time)."""
        store, write = RolloutStore(root), RolloutStore.write_step

        def write_step(run_id, step, row):
            self.append(("row", step, row.get("checkpoint_seconds") is not None))
            return write(store, run_id, step, row)

        store.write_step = write_step
        return store


def _close(tmp_path, log: Log, monkeypatch, steps=4, every=2, start=0, checkpoint=None, limit=3):
    cfg = GRPOConfig.model_validate({"storage": {"root": str(tmp_path)},
                                     "run": {"steps": steps, "checkpoint_every": every,
                                             "max_failed_reward_steps": limit}})  # fmt: skip
    run = RunState("r", start, start, "m", "m", checkpoint, checkpoint is not None)
    units = SimpleNamespace(
        checkpoint=lambda step, state, keep, kept: log.append(("checkpoint", step, kept)) or 0.5
    )
    pipeline = SimpleNamespace(to_keep=lambda: ["ahead"])
    compactor = SimpleNamespace(submit=lambda step, final: log.append(("compact", step, final)))
    trackers = SimpleNamespace(closed=lambda step: log.append(("trackers", step)),
                               finish=lambda report: log.append(("finish", report is not None)),
                               links=lambda: {})  # fmt: skip
    reporter = SimpleNamespace(
        step=lambda rec: log.append(("line", rec.step)), flush=lambda: log.append(("flush",))
    )
    monkeypatch.setattr("grpoflow.flows.training.step_close.StepReporter", lambda cfg, run: reporter)
    close = StepClose(cfg, run, StepRunner(task_runs=False), units, pipeline, compactor, trackers)
    close.store = log.store(Path(tmp_path))
    return close


def test_a_step_closes_row_then_checkpoint_then_its_listeners_and_only_at_checkpoints(tmp_path, monkeypatch):
    log = Log()
    close = _close(tmp_path, log, monkeypatch)
    for step in range(4):
        close.step(step, close.runner.begin(step), [])
    assert log == [
        ("row", 0, False), ("line", 0),
        ("row", 1, False), ("checkpoint", 1, ["ahead"]), ("row", 1, True), ("compact", 1, False), ("trackers", 1),
        ("line", 1),
        ("row", 2, False), ("line", 2),
        ("row", 3, False), ("checkpoint", 3, ["ahead"]), ("row", 3, True), ("compact", 3, True), ("trackers", 3),
        ("line", 3),
    ]  # fmt: skip
    rows = RolloutStore(tmp_path).read_steps("r")
    assert [r["step"] for r in rows] == [0, 1, 2, 3]  # one row each: the second write replaced the first
    assert [r.get("checkpoint_seconds") is not None for r in rows] == [False, True, False, True]


def test_a_resumed_run_hands_the_steps_closed_before_the_kill_to_its_listeners_first(tmp_path, monkeypatch):
    log = Log()
    _close(
        tmp_path,
        log,
        monkeypatch,
        steps=6,
        start=4,
        checkpoint=tmp_path / "checkpoints" / "r" / "step-000003",
    )
    assert log == [("compact", 3, False), ("trackers", 3)]


def test_a_reward_broken_too_long_stops_after_its_row_and_before_its_checkpoint(tmp_path, monkeypatch):
    log = Log()
    close = _close(tmp_path, log, monkeypatch, steps=4, every=1, limit=2)
    broken = [BrokenReward(index=0, name="acc", required=True, failed=4, total=4, reason="ValueError('x')",
                           trace=None, hint=None)]  # fmt: skip
    close.step(0, close.runner.begin(0), broken)
    with pytest.raises(BrokenRewardError, match="reward 'acc' failed on every completion of steps 0-1"):
        close.step(1, close.runner.begin(1), broken)
    assert log == [("row", 0, False), ("checkpoint", 0, ["ahead"]), ("row", 0, True), ("compact", 0, False),
                   ("trackers", 0), ("line", 0), ("row", 1, False), ("line", 1), ("flush",)]  # fmt: skip


def test_due_is_every_n_steps_and_always_after_the_last():
    assert [s for s in range(7) if due(s, 3, 7)] == [2, 5, 6]

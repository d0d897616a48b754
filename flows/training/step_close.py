"""What happens when a step closes (docs/architecture.md, section 2), in one hook the loop calls.

The loop in flows/training/train.py names a step's units (generate, score, advantages, update, push, eval);
`StepClose.step` then does, in order: the steps row; the broken-reward watch; when due, the checkpoint
(with the batches kept ahead, for a reproducible resume) and the same row again, now with its time;
and, once the step is closed (its checkpoint written), the listeners of a closed step: the background
compaction and the trackers, which only ever see what a resume cannot redo. A resume first hands them
the steps that closed before the kill.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

from prefect import get_run_logger

from grpoflow.flows.config import GRPOConfig
from grpoflow.flows.training.pipeline import RolloutPipeline
from grpoflow.flows.training.progress import StepReporter
from grpoflow.flows.training.runner import StepRunner, StepUnits
from grpoflow.flows.training.runs import RunState, checkpoint_state
from grpoflow.flows.viewing.report import write_report
from grpoflow.flows.viewing.tracking import Tracking
from grpoflow.storage.compact import BackgroundCompactor
from grpoflow.storage.rollouts import RolloutStore
from grpoflow.tasks.rewards.broken_rewards import BrokenReward, BrokenRewardError, MaskedBatch
from grpoflow.tasks.step_record import StepRecord

# Listeners of each step's row as it is written, attached by the code that started the run in this
# process (grpoflow.trl's callbacks and progress bar); unlike the trackers they see steps a resume may
# redo, and run on the loop's thread: they only read.
_WRITTEN: dict[str, list[Callable[[int, dict[str, Any]], Any]]] = {}


@contextlib.contextmanager
def step_listeners(run_id: str, *listeners: Callable[[int, dict[str, Any]], Any]):
    """Call each of `listeners` with (step, its `steps` row) as run `run_id` writes its rows here."""
    _WRITTEN[run_id] = list(listeners)
    try:
        yield
    finally:
        _WRITTEN.pop(run_id, None)


def due(step: int, every: int, steps: int) -> bool:
    """Whether something done every `every` steps (push, checkpoint) is due after `step`; always
    after the last step."""
    return (step + 1) % every == 0 or step == steps - 1


class StepClose:
    """The close hook of one run's steps (the module doc)."""

    def __init__(
        self,
        cfg: GRPOConfig,
        run: RunState,
        runner: StepRunner,
        units: StepUnits,
        pipeline: RolloutPipeline,
        compactor: BackgroundCompactor,
        trackers: Tracking | None,
    ):
        self.cfg, self.run_id, self.steps = cfg, run.run_id, cfg.run.steps
        self.runner, self.units, self.pipeline, self.trackers = runner, units, pipeline, trackers
        self.store = RolloutStore(Path(cfg.storage.root))
        self.reporter = StepReporter(cfg, run)
        self.watch = RewardWatch(cfg, run.run_id)
        steps = self.steps
        self.on_closed: list[Callable[[int], Any]] = [lambda s: compactor.submit(s, final=s == steps - 1)]
        if trackers is not None:  # closed steps only: a resume never redoes what they show
            self.on_closed.append(trackers.closed)
        if run.checkpoint is not None:  # steps closed before a kill, and a killed compaction's leftovers
            compactor.submit(run.start_step - 1, final=run.start_step >= steps)
            if trackers is not None:  # and what the trackers missed of them
                trackers.closed(run.start_step - 1)

    def step(
        self, step: int, rec: StepRecord, broken: list[BrokenReward], masked: MaskedBatch | None = None
    ) -> None:
        """Close `step`; raises the broken-reward watch's error once its row and line are out."""
        # The steps row lands before the checkpoint: a kill in between resumes from the previous
        # checkpoint, which deletes this step's rows and redoes it, so no table ever lacks a row.
        row = self.runner.end(rec)
        self.store.write_step(self.run_id, step, row)
        # After its rows (the failed cells are in the tables) and before its checkpoint (a resume
        # redoes the step), a reward broken for too long stops the run, once its line is shown.
        stop = self.watch.step(step, broken, masked)
        if stop is None and due(step, self.cfg.run.checkpoint_every, self.steps):
            self._checkpoint(step, rec)
            for closed in self.on_closed:
                closed(step)
        self.reporter.step(rec)
        for listener in _WRITTEN.get(self.run_id, ()):
            listener(step, row)
        if stop is not None:
            self.reporter.flush()
            raise stop

    def _checkpoint(self, step: int, rec: StepRecord) -> None:
        state = checkpoint_state(self.cfg, self.run_id, step, step + 1)
        kept = self.pipeline.to_keep()  # run.reproducible: a resume trains on the batches ahead as they are
        rec.times.checkpoint = self.units.checkpoint(step, state, self.cfg.run.keep_checkpoints, kept)
        self.store.write_step(self.run_id, step, self.runner.end(rec))  # the same row, with its checkpoint

    def finish(self) -> dict[str, Any]:
        """The run's summary, once the trackers have the report's plots."""
        if self.trackers is not None:
            self.trackers.finish(_report(self.cfg.storage.root, self.run_id))
        self.reporter.finish(self.trackers.links() if self.trackers is not None else None)
        return self.reporter.summary()


def _report(root: str, run_id: str) -> Path | None:
    """`grpoflow report`'s files of the run (<root>/reports/<run>), for the trackers; a report that
    cannot be drawn costs the trackers their plots, never the run."""
    try:
        return write_report(root, run_id)
    except Exception as e:
        get_run_logger().warning("report not written for the trackers: %r", e)
        return None


@contextlib.contextmanager
def finished(trackers: Tracking | None):
    """Trackers of a run that fails still get the steps that closed before, and are closed (at most
    tracking.finish_timeout_s: a dead tracking server never holds the run)."""
    try:
        yield
    except BaseException:
        if trackers is not None:
            trackers.finish(None)
        raise


class RewardWatch:
    """Counts, per required reward, the consecutive steps it failed on every completion, and the
    consecutive steps whose every completion was masked (each one was logged as its batch was scored),
    and stops the run at `run.max_failed_reward_steps` of either."""

    def __init__(self, cfg: GRPOConfig, run_id: str):
        self.cfg, self.run_id = cfg, run_id
        self.streak: dict[str, list[int]] = {}  # reward name -> the steps of its current streak
        self.masked: list[int] = []  # the steps of the current streak of batches masked whole

    def step(
        self, step: int, broken: list[BrokenReward], masked: MaskedBatch | None = None
    ) -> BrokenRewardError | None:
        """Count the step's broken rewards and whether its batch was masked whole; the error to stop the
        run with, once a streak is due (a broken reward's, the more precise, first)."""
        limit = self.cfg.run.max_failed_reward_steps
        broken = [b for b in broken if b.required]
        names = {b.name for b in broken}
        self.streak = {k: v for k, v in self.streak.items() if k in names}
        self.masked = [*self.masked, step] if masked is not None else []
        for b in broken:
            steps = self.streak.setdefault(b.name, [])
            steps.append(step)
            if limit and len(steps) >= limit:
                return self._error(
                    f"reward {b.name!r} failed on every completion of {_where(steps)} "
                    f"(run.max_failed_reward_steps={limit}): {b.reason}{'; ' + b.hint if b.hint else ''}; "
                    "nothing was trained on it."
                )
        if masked is not None and limit and len(self.masked) >= limit:
            return self._error(
                f"every completion of {_where(self.masked)} was masked, no valid value of every required "
                f"reward (run.max_failed_reward_steps={limit}): {'; '.join(masked.causes)}; nothing was "
                "trained."
            )
        return None

    def _error(self, what: str) -> BrokenRewardError:
        # one line, whatever the exception's message holds
        return BrokenRewardError(
            " ".join(f"{what} Fix it and continue the run with --resume {self.run_id}".split())
        )


def _where(steps: list[int]) -> str:
    return f"step {steps[0]}" if len(steps) == 1 else f"steps {steps[0]}-{steps[-1]}"

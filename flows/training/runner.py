"""How a training step's units run: chosen once, at setup, and timed by the runner.

`StepRunner` decides how units run (`run.step_task_runs`): the rollout batches and the learner's side
of a step (`train-step`) as Prefect task runs, or as plain calls (batches on threads that carry the flow
run's context: no task run per step). Checkpoints, a run's first push and the recovery of a failed
write or push are task runs either way, for their retries and their place in the UI. It also keeps the
step's clock: the learner's wait for generation, and what Prefect's task runs add to the step's
critical path (a submit call; a task called in the loop, minus the time its body reports; the part of
the learner's wait a batch's body did not run in).

`StepUnits` binds the units of tasks/steps.py to one run (its learner, weight push, servers, store), so
the loop in flows/training/train.py calls them by name; a failed write or push is run again, in one place
(`_again`), as its own task with its retries, dead servers revived first.
"""

from __future__ import annotations

import contextlib
import contextvars
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from prefect import Task, get_run_logger
from prefect.utilities.annotations import quote

from grpoflow.tasks.push.push import PushStats, WeightPush
from grpoflow.tasks.rollouts.inference_api import InferenceUnavailableError
from grpoflow.tasks.rollouts.replicas import ReplicaSet
from grpoflow.tasks.step_record import StepRecord
from grpoflow.tasks.steps import (
    RolloutBatch,
    RolloutJob,
    eval_batch,
    persist,
    push_weights,
    save_checkpoint,
    train_step,
    update,
)


def _quote(a: Any) -> Any:
    # Prefect walks task arguments (for the UI and futures); token lists and learners are not for it.
    return a if isinstance(a, int | float | str | None) else quote(a)


class StepRunner:
    """Runs units as task runs or plain calls (the module doc), and times each step."""

    def __init__(self, task_runs: bool):
        self.task_runs = task_runs
        self.pool = None if task_runs else ThreadPoolExecutor(thread_name_prefix="rollout")
        self.record = StepRecord(-1)
        self._start = self._end = None  # a step's wall time runs from the previous step's end

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=False, cancel_futures=True)  # a failed run does not wait for batches

    def begin(self, step: int) -> StepRecord:
        """A new step's record; its wall time runs from the previous step's end."""
        self.record, self._start = StepRecord(step), self._end or time.perf_counter()
        return self.record

    def end(self, record: StepRecord) -> dict[str, float]:
        """The step's `steps` row as of now (again after a checkpoint: the same row, longer). Its wall
        time leaves out the held-out eval, which is no part of training."""
        self._end = time.perf_counter()
        record.times.wall = self._end - self._start - (record.times.eval or 0.0)
        return record.row()

    def submit(self, task: Task, *args: Any) -> Future | Any:
        """A per-step unit run ahead of the loop (a rollout batch): its task run, or a plain call on a
        thread of this flow run's context."""
        t0 = time.perf_counter()
        if self.task_runs:
            future = task.submit(*map(_quote, args))
        else:
            future = self.pool.submit(contextvars.copy_context().run, task.fn, *args)
        self.record.times.prefect += time.perf_counter() - t0
        return future

    def waited(self, batch: RolloutBatch, t_wait: float) -> None:
        """The oldest batch arrived now, after the learner waited since `t_wait`: count the idle time,
        and as Prefect's the part of it the task's body (its start and end are in the batch) did not
        run in: its dispatch, when it ran late, and its result's hand-off."""
        now, times = time.perf_counter(), self.record.times
        times.wait = now - t_wait
        body = max(0.0, min(batch.body_end, now) - max(batch.body_start, t_wait))
        times.prefect += max(0.0, times.wait - body)

    def call(self, task: Task, *args: Any, **kwargs: Any) -> float:
        """An occasional unit whose body returns its seconds, as its own task run, always; the rest of
        the call counts as Prefect's."""
        t0 = time.perf_counter()
        seconds = task(*map(_quote, args), **{k: _quote(v) for k, v in kwargs.items()})
        self.record.times.prefect += max(0.0, time.perf_counter() - t0 - seconds)
        return seconds

    @contextlib.contextmanager
    def recorded(self, record: StepRecord) -> Iterator[None]:
        """The learner's side of a step, run here, with `train-step` submitted beside it as its task run
        (task runs on): Prefect's part of the step is the submit call; the run's bookkeeping is on the
        task runner's thread. The task run ends with the record, or fails with the work's error."""
        if not self.task_runs:
            yield
            return
        t0 = time.perf_counter()
        outcome: Future = Future()
        train_step.submit(quote(outcome))
        record.times.prefect += time.perf_counter() - t0
        try:
            yield
        except BaseException as e:  # an interrupt ends the task run as a failure, not in its thread
            outcome.set_exception(e if isinstance(e, Exception) else RuntimeError(f"interrupted: {e!r}"))
            raise
        outcome.set_result(record)


class StepUnits:
    """The units of a step bound to one run; the loop calls them by name."""

    def __init__(
        self, runner: StepRunner, learner, pusher: WeightPush, servers: ReplicaSet, *, root: str, run_id: str
    ):
        self.runner, self.learner, self.pusher, self.servers = runner, learner, pusher, servers
        self.root, self.run_id = root, run_id
        self.recover: Callable[[Exception], None] | None = None  # brings dead servers back
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="persist")

    def close(self) -> None:
        self._writer.shutdown(wait=True)

    def update(self, groups) -> dict[str, float]:
        return update(self.learner, groups)

    def persist(self, step: int, groups) -> Callable[[], float]:
        """Start writing the step's rollouts and rewards on a thread (beside the update); the returned
        call waits for the write and gives its seconds (a failed write runs again as its own task)."""
        writing = self._writer.submit(persist.fn, self.root, self.run_id, step, groups)

        def done() -> float:
            try:
                return writing.result()
            except Exception as e:
                return self._again(
                    persist, f"step {step}: writing rollouts", e, self.root, self.run_id, step, groups
                )

        return done

    def push(self, version: int) -> PushStats:
        """Push the learner's weights as `version`, a plain call inside the step; a failed push runs
        again as its own task."""
        try:
            return push_weights.fn(self.learner, version, self.pusher, self.servers)
        except Exception as e:
            return self._again(
                push_weights, f"weight push v{version}", e, self.learner, version, self.pusher, self.servers
            )

    def first_push(self, version: int) -> PushStats:
        """A run's first push (resume, external servers): the servers must serve the learner's weights."""
        return self._as_task(push_weights, self.learner, version, self.pusher, self.servers)

    def evaluate(self, step: int, rows: list[dict], job: RolloutJob, train_groups) -> RolloutBatch:
        """Generate and score the held-out `rows` (`job`: split 'eval', seeded by row position) on the
        servers, as the `eval-batch` task run, and write them into the step's files beside its training
        rows (a resume that redoes the step redoes its eval); the eval batch."""
        batch = self._as_task(eval_batch, step, rows, list(range(len(rows))), job)
        self._as_task(persist, self.root, self.run_id, step, [*train_groups, *batch.groups])
        return batch

    def checkpoint(self, step: int, state: dict, keep: int, kept: list[RolloutBatch] = ()) -> float:
        return self.runner.call(
            save_checkpoint,
            self.learner,
            root=self.root,
            run_id=self.run_id,
            step=step,
            state=state,
            keep=keep,
            kept=kept,
        )

    def _again(self, task: Task, what: str, error: Exception, *args: Any) -> Any:
        """The one place a failed unit is run again: as its own task run (its retries)."""
        get_run_logger().warning("%s failed (%r); retrying", what, error)
        return self._as_task(task, *args)

    def _as_task(self, task: Task, *args: Any) -> Any:
        try:
            return task(*map(_quote, args))
        except InferenceUnavailableError as e:  # no server took it: bring them back, then again
            if self.recover is None:
                raise
            self.recover(e)
            return task(*map(_quote, args))

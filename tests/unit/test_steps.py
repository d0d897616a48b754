"""A step's units as the run calls them (flows/training/runner.py over tasks/steps.py), on the real tiny model
and real Parquet files: the step's rows are written beside the update, a write or push that fails runs again
as its own task (the real Prefect task, on the session's ephemeral API, its retry delay cut to 0 for the test)
without undoing the applied update, and the runner's clock counts what Prefect adds to the step's critical
path."""

from __future__ import annotations

import pytest
from prefect import flow

import grpoflow.flows.training.runner  # noqa: F401  (binds the package; its attribute is used)
from grpoflow import flows
from grpoflow.flows.training.runner import StepRunner, StepUnits
from grpoflow.storage.rollouts import RolloutStore
from grpoflow.tasks.config.inference import InferenceConfig, SyncConfig
from grpoflow.tasks.push.push import weight_push
from grpoflow.tasks.rollouts.inference_api import InferenceUnavailableError
from grpoflow.tasks.rollouts.replicas import Replica, ReplicaSet
from grpoflow.tasks.steps import RolloutBatch, persist, push_weights
from tests.support import make_learner, rich_group

pytestmark = pytest.mark.unit


@pytest.fixture
def no_retry_delay(monkeypatch):
    monkeypatch.setattr(flows.training.runner, "persist", persist.with_options(retry_delay_seconds=0))
    monkeypatch.setattr(
        flows.training.runner, "push_weights", push_weights.with_options(retry_delay_seconds=0)
    )


def trained_weight(learner) -> float:
    return float(next(learner.model.parameters()).detach().double().sum())


def in_a_flow_run(call, *args):
    """`call(*args)` inside a flow run, where the loop calls the units (their warnings go to its log)."""
    return flow(name="one-step-unit")(lambda: call(*args))()


def units_for(learner, root) -> StepUnits:
    # Nothing listens on the discard port: every request to this "server" is refused.
    servers = ReplicaSet([Replica(0, "http://127.0.0.1:9")])
    pusher = weight_push(root, "run1", SyncConfig(), InferenceConfig(retries=0))
    return StepUnits(StepRunner(task_runs=False), learner, pusher, servers, root=str(root), run_id="run1")


def test_the_rows_land_beside_the_update(tiny_model_dir, tmp_path):
    learner = make_learner(tiny_model_dir, lr=1e-2, total_steps=4, loss_type="dapo")
    before = trained_weight(learner)
    units = units_for(learner, tmp_path)
    groups = [rich_group("train-00000000"), rich_group("train-00000001")]

    written = units.persist(0, groups)
    m = units.update(groups)
    assert written() > 0 and m["train/samples"] == 2  # one trained completion per group
    assert trained_weight(learner) != before
    got = RolloutStore(tmp_path).read_groups("run1", 0)
    assert sorted(g.group_id for g in got) == ["train-00000000", "train-00000001"]


def test_a_failed_push_runs_again_as_its_task_after_reviving_the_servers(
    tiny_model_dir, tmp_path, prefect_api, no_retry_delay
):
    learner = make_learner(tiny_model_dir, lr=1e-2, total_steps=4, loss_type="dapo")
    units = units_for(learner, tmp_path)
    revived = []
    units.recover = revived.append
    before = trained_weight(learner)
    units.update([rich_group()])

    with pytest.raises(InferenceUnavailableError):
        in_a_flow_run(units.push, 1)
    # Pushed in the step, then as push-weights (with its retry), then again once the servers were
    # "revived" (this test's recover only records the call): each failed, so the error surfaces.
    assert len(revived) == 1 and isinstance(revived[0], InferenceUnavailableError)
    assert units.servers.version == 0 and trained_weight(learner) != before  # the update stays


def test_a_failed_write_runs_again_as_its_task(tiny_model_dir, tmp_path, prefect_api, no_retry_delay):
    learner = make_learner(tiny_model_dir, lr=1e-2, total_steps=4, loss_type="dapo")
    root = tmp_path / "store"
    root.write_text("a file where the store should be")
    units = units_for(learner, root)

    written = units.persist(3, [rich_group()])
    units._writer.submit(lambda: None).result()  # one writer thread: the failed write is over
    root.unlink()  # the disk is fixed before the write runs again
    assert in_a_flow_run(written) > 0
    assert len(RolloutStore(root).read_groups("run1", 3)) == 1


def test_a_failed_update_leaves_the_rows_written(tiny_model_dir, tmp_path):
    learner = make_learner(tiny_model_dir, lr=1e-2, total_steps=4, loss_type="dapo")

    def broken(samples):
        raise RuntimeError("out of memory")

    learner.train_step = broken
    units = units_for(learner, tmp_path)
    written = units.persist(0, [rich_group()])
    with pytest.raises(RuntimeError, match="out of memory"):
        units.update([rich_group()])
    units.close()  # the run's exit waits for the write: a resume deletes a step's rows past its checkpoint
    assert written() > 0 and len(RolloutStore(tmp_path).read_groups("run1", 0)) == 1


def test_the_runner_counts_what_prefect_adds_to_the_critical_path(monkeypatch):
    """Hand-derived: a task call's time outside its body, submit calls, and the part of the learner's
    wait for a rollout batch that its body did not run in (a dispatch while the learner trained is
    hidden; a late start and the result's hand-off are not)."""
    now = [0.0]
    monkeypatch.setattr(flows.training.runner.time, "perf_counter", lambda: now[0])
    runner = StepRunner(task_runs=False)
    rec = runner.begin(0)
    rec.times.prefect = 0.002  # a submit call's

    def arrive(t_wait, body_start, body_end, at):
        now[0] = at
        runner.waited(RolloutBatch(0, [], {}, body_start, body_end), t_wait)

    arrive(0.010, -0.5, 0.040, 0.045)  # generated while the learner trained: 0.005 s of hand-off
    assert rec.times.wait == pytest.approx(0.035) and rec.times.prefect == pytest.approx(0.007)
    arrive(0.100, -0.5, 0.090, 0.102)  # ready before the learner asked: the whole 0.002 s wait
    arrive(0.200, 0.210, 0.230, 0.231)  # started late: 0.010 s of dispatch + 0.001 s of hand-off
    assert rec.times.prefect == pytest.approx(0.007 + 0.002 + 0.011)

    def checkpoint(seconds):
        now[0] += seconds
        return seconds - 0.02  # what its body reports

    now[0] = 0.5
    assert runner.call(checkpoint, 0.4) == pytest.approx(0.38)
    now[0] = 2.0
    row = runner.end(rec)
    assert row["prefect_overhead_seconds"] == pytest.approx(0.04)
    assert row["wall_seconds"] == 2.0 and row["prefect_overhead_frac"] == pytest.approx(0.02)
    now[0] = 3.5
    assert runner.end(runner.begin(1))["wall_seconds"] == 1.5  # the next step starts where this one ended


def test_a_batch_is_taken_when_its_body_hands_it_over_and_a_failed_one_raises():
    from concurrent.futures import Future

    from grpoflow.tasks.steps import handed_over

    task, handoff = Future(), Future()  # the task run still being recorded: its future is not done
    handoff.set_result("batch")
    assert handed_over(task, handoff) == "batch"
    task, handoff = Future(), Future()  # failed after its retries: the body never handed anything over
    task.set_exception(ConnectionError("no server"))
    with pytest.raises(ConnectionError, match="no server"):
        handed_over(task, handoff)

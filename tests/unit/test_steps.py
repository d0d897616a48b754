"""The train-step task's own work (tasks/steps.py), on the real tiny model and real Parquet files: the
step's rows are written beside the update, and a write or push that fails comes back in the outcome
for the flow to run again as its own task, instead of failing a step whose update is applied."""

from __future__ import annotations

import pytest

from storage.rollouts import RolloutStore
from tasks.config import InferenceConfig, SyncConfig
from tasks.inference import InferenceUnavailableError
from tasks.replicas import Replica, ReplicaSet
from tasks.steps import PushJob, train_step
from tasks.tiny_model import build_tiny_model
from tests.unit.test_learn import make_learner
from tests.unit.test_store import rich_group

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("m") / "tiny")


def trained_weight(learner) -> float:
    return float(next(learner.model.parameters()).detach().double().sum())


def test_the_rows_land_and_a_failed_push_is_returned(model_dir, tmp_path):
    learner = make_learner(model_dir, lr=1e-2, total_steps=4, loss_type="dapo")
    before = trained_weight(learner)
    # Nothing listens on the discard port: every request is refused.
    servers = ReplicaSet([Replica(0, "http://127.0.0.1:9")])
    job = PushJob(str(tmp_path), "run1", SyncConfig(), InferenceConfig(retries=0), servers)
    groups = [rich_group("train-00000000"), rich_group("train-00000001")]

    out = train_step(learner, groups, step=0, root=str(tmp_path), run_id="run1", push=job, version=1)

    assert isinstance(out.push_error, InferenceUnavailableError)
    assert out.persist_error is None
    assert out.metrics["train/samples"] == 2  # one trained completion per group
    assert trained_weight(learner) != before  # the update is applied whatever the push did
    assert out.metrics["write_seconds"] > 0 and out.seconds >= out.metrics["write_seconds"]
    assert "sync/total_seconds" not in out.metrics
    assert servers.version == 0  # no server took version 1
    store = RolloutStore(tmp_path)
    assert sorted(g.group_id for g in store.read_groups("run1", 0)) == ["train-00000000", "train-00000001"]


def test_a_failed_write_is_returned_and_the_update_applied(model_dir, tmp_path):
    learner = make_learner(model_dir, lr=1e-2, total_steps=4, loss_type="dapo")
    before = trained_weight(learner)
    root = tmp_path / "not-a-dir"
    root.write_text("a file where the store should be")

    out = train_step(learner, [rich_group()], step=3, root=str(root), run_id="run1")

    assert isinstance(out.persist_error, OSError)
    assert out.push_error is None and "write_seconds" not in out.metrics
    assert out.metrics["train/samples"] == 1 and trained_weight(learner) != before


def test_a_failed_update_fails_the_task(model_dir, tmp_path):
    learner = make_learner(model_dir, lr=1e-2, total_steps=4, loss_type="dapo")

    def broken(samples):
        raise RuntimeError("out of memory")

    learner.train_step = broken
    with pytest.raises(RuntimeError, match="out of memory"):
        train_step(learner, [rich_group()], step=0, root=str(tmp_path), run_id="run1")
    # The rows were written all the same: a resume deletes a step's rows past its checkpoint.
    assert len(RolloutStore(tmp_path).read_groups("run1", 0)) == 1


def test_the_step_timer_counts_what_prefect_adds_to_the_critical_path(monkeypatch):
    """Hand-derived: a task call's time outside its body, submit calls, and the part of the learner's
    wait for a rollout batch that its body did not run in (a dispatch while the learner trained is
    hidden; a late start and the result's hand-off are not)."""
    import flows.train
    from tasks.steps import RolloutBatch

    now = [0.0]
    monkeypatch.setattr(flows.train.time, "perf_counter", lambda: now[0])
    timer = flows.train.StepTimer()
    timer.submitted(0.002)

    def arrive(t_wait, body_start, body_end, at):
        now[0] = at
        timer.waited(RolloutBatch(0, [], {}, body_start, body_end), t_wait)

    arrive(0.010, -0.5, 0.040, 0.045)  # generated while the learner trained: 0.005 s of hand-off
    assert timer.wait == pytest.approx(0.035) and timer.prefect == pytest.approx(0.007)
    arrive(0.100, -0.5, 0.090, 0.102)  # ready before the learner asked: the whole 0.002 s wait
    arrive(0.200, 0.210, 0.230, 0.231)  # started late: 0.010 s of dispatch + 0.001 s of hand-off
    assert timer.prefect == pytest.approx(0.007 + 0.002 + 0.011)

    def task(seconds):
        now[0] += seconds
        return {"body": seconds - 0.02}

    now[0] = 0.5
    assert timer.call(task, 0.4, body=lambda out: out["body"]) == {"body": pytest.approx(0.38)}
    now[0] = 2.0
    m = timer.metrics()
    assert m["prefect_overhead_seconds"] == pytest.approx(0.04)
    assert m["wall_seconds"] == 2.0 and m["prefect_overhead_frac"] == pytest.approx(0.02)


def test_a_batch_is_taken_when_its_body_hands_it_over_and_a_failed_one_raises():
    from concurrent.futures import Future

    from tasks.steps import handed_over

    task, handoff = Future(), Future()  # the task run still being recorded: its future is not done
    handoff.set_result("batch")
    assert handed_over(task, handoff) == "batch"
    task, handoff = Future(), Future()  # failed after its retries: the body never handed anything over
    task.set_exception(ConnectionError("no server"))
    with pytest.raises(ConnectionError, match="no server"):
        handed_over(task, handoff)

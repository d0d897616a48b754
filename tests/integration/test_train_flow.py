"""grpo-train end to end: real vLLM CPU server, real Prefect API, real Parquet + DuckDB.

The session's vLLM server (tests/integration/conftest.py) serves the tiny model; every run here
pushes its own initial weights first (an external server must serve exactly the learner's weights),
so runs sharing the server do not see each other's training.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from grpoflow.storage.rollouts import RolloutStore
from grpoflow.storage.sql import query, run_status
from tests.drill import KILL_DRILL, KILL_DRILL_SETS, clean_store, store_check
from tests.support import tiny_cfg, unpause

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]


def task_runs(flow_run_id: str, steps: int, timeout_s: float = 60.0) -> tuple[list, list]:
    """A flow run's task runs, and its train-step runs' logs, as the Prefect API (the UI) has them once
    it has every step's (the API records task runs from the events the run sent, a little later)."""
    import time

    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId, LogFilter, LogFilterTaskRunId
    from prefect.events.worker import EventsWorker
    from prefect.logging.handlers import APILogWorker

    for worker in (EventsWorker, APILogWorker):
        worker.drain_all(timeout=10)
    deadline = time.monotonic() + timeout_s
    with get_client(sync_client=True) as client:
        while True:
            flow_runs = FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id]))
            runs = client.read_task_runs(flow_run_filter=flow_runs, limit=200)
            done = [r for r in runs if r.state is not None and r.state.is_final()]
            if (len(done) >= max(1, 2 * steps) and len(done) == len(runs)) or time.monotonic() > deadline:
                ids = [r.id for r in runs if r.name.startswith("train-step")]
                return runs, client.read_logs(LogFilter(task_run_id=LogFilterTaskRunId(any_=ids)))
            time.sleep(0.5)


def step_files(root: Path, table: str, run_id: str) -> list[int]:
    """The steps stored in `table` (step files, and compacted ranges' steps)."""
    return RolloutStore(root).steps_written(table, run_id)


@pytest.mark.slow
def test_reward_goes_up_and_store_is_contiguous(tmp_path, vllm_server, tiny_model_dir, prefect_api):
    from grpoflow.flows.training.train import grpo_train

    # Pinned: tiny-letters at seed 0 with run.reproducible, so this curve is the same bits every run
    # (the reward's rise asserted below depends on no timing).
    steps = 16
    sets = {
        "run.steps": steps,
        "run.run_id": "up",
        "storage.compact_every": 2,
        "run.reproducible": True,
    }
    cfg = tiny_cfg(tmp_path, tiny_model_dir, vllm_server.url, **sets)
    # Readers during writes and compactions (after the checkpoints of steps 9 and 15): SQL queries in a
    # loop while the run writes never error or see partial files or a step twice.
    stop, errors, seen = threading.Event(), [], []

    def reader():
        while not stop.is_set():
            try:
                seen.append(query(tmp_path, "SELECT count(*), count(DISTINCT step) FROM rollouts")[1][0])
            except Exception as e:  # any error is a failure of the atomic-write guarantee
                errors.append(repr(e))

    t = threading.Thread(target=reader)
    t.start()
    try:
        summary = grpo_train(config=cfg)
    finally:
        stop.set()
        t.join()
    assert not errors, errors[:3]
    assert all(n == 64 * k for n, k in seen) and len({k for _, k in seen}) > 3  # whole steps only
    assert summary["steps_trained"] == steps
    for table in ("rollouts", "rewards", "steps"):
        assert step_files(tmp_path, table, "up") == list(range(steps)), table
        # compacted by the run before it returned: 2-step ranges, no step file, nothing superseded
        files = sorted(p.name for p in (tmp_path / table / "run_id=up").iterdir())
        assert files == [f"range-{lo:06d}-{lo + 1:06d}.parquet" for lo in range(0, steps, 2)], files
    _, rows = query(
        tmp_path,
        "SELECT step, avg(reward) FILTER (WHERE reward_valid) FROM rollouts GROUP BY step ORDER BY step",
    )
    curve = [r[1] or 0.0 for r in rows]
    first, last = sum(curve[:4]) / 4, sum(curve[-4:]) / 4
    assert last > 0.3 and last > 3 * first, curve
    # steps rows carry the timing breakdown and the pipeline respected its staleness bound
    _, srows = query(tmp_path, "SELECT max(staleness_max), min(wall_seconds), count(*) FROM steps")
    assert srows[0][0] <= cfg.algorithm.max_staleness and srows[0][1] > 0 and srows[0][2] == steps
    # Prefect artifacts: progress (100%), step-metrics table, markdown summary with the store and SQL
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        arts = {a.key: a for a in client.read_artifacts() if a.key and a.key.startswith("up-")}
    assert {"up-progress", "up-steps", "up-summary"} <= set(arts)
    assert float(arts["up-progress"].data) == 100.0
    assert "grpoflow sql" in arts["up-summary"].data and str(tmp_path) in arts["up-summary"].data
    # The UI's task runs: each step's generation and its update (written, trained, pushed in one run,
    # with its log line), the checkpoints, the first push (an external server); no step's write or push
    # failed, so none ran on its own.
    runs, logs = task_runs(RolloutStore(tmp_path).read_run_meta("up")["flow_runs"][-1], steps)
    names = sorted(r.name.rsplit("-", 1)[0] for r in runs)
    assert names == ["checkpoint"] * 2 + ["push-weights"] + ["rollout-batch"] * steps + ["train-step"] * steps
    assert all(r.state.is_completed() for r in runs)
    trains = [r for r in runs if r.name.startswith("train-step")]
    _, trow = query(tmp_path, "SELECT sum(\"train/seconds\") FROM steps WHERE run_id = 'up'")
    assert sum(r.total_run_time.total_seconds() for r in trains) > 0.5 * trow[0][0]
    lines = [log.message for log in logs if log.message != "Finished in state Completed()"]
    assert len(lines) == steps and all(x.startswith("wrote rollouts + rewards in ") for x in lines), lines[:2]
    assert "; trained " in lines[0] and f"; pushed version {steps} in " in " ".join(lines)
    # grpoflow report on this finished run: the plotted reward curve is the SQL one
    from grpoflow.flows.viewing.report import write_report

    data = json.loads((write_report(tmp_path, "up") / "report.json").read_text())
    assert [r for _, r in data["reward_curve"]] == pytest.approx([r[1] for r in rows])


def test_without_step_task_runs_the_same_work_lands(tmp_path, vllm_server, tiny_model_dir, prefect_api):
    """run.step_task_runs off: no task run per step (a checkpoint and the first push still are one),
    every table whole, the pipeline ahead as usual (its batches on threads of the flow run)."""
    from grpoflow.flows.training.train import grpo_train

    steps = 4
    sets = {
        "run.steps": steps,
        "run.run_id": "plain",
        "run.step_task_runs": False,
        "algorithm.max_staleness": 1,
    }
    summary = grpo_train(config=tiny_cfg(tmp_path, tiny_model_dir, vllm_server.url, **sets))
    assert summary["steps_trained"] == steps
    for table in ("rollouts", "rewards", "steps"):
        assert step_files(tmp_path, table, "plain") == list(range(steps)), table
    _, rows = query(
        tmp_path, "SELECT max(staleness_max), min(policy_version), max(policy_version) FROM steps"
    )
    assert rows[0][0] <= 1 and rows[0][1:] == (1, steps)  # staleness bound kept; every push landed
    runs, _ = task_runs(RolloutStore(tmp_path).read_run_meta("plain")["flow_runs"][-1], 0, timeout_s=5)
    assert sorted(r.name.rsplit("-", 1)[0] for r in runs) == ["checkpoint", "push-weights"]  # the first push


def _losses(root: Path, run_id: str) -> list[float]:
    _, rows = query(root, 'SELECT "train/loss" FROM steps WHERE run_id = $run ORDER BY step', {"run": run_id})
    return [r[0] for r in rows]


def test_staleness_zero_equals_plain_synchronous_loop(tmp_path, vllm_server, tiny_model_dir, prefect_api):
    """max_staleness 0 through the pipelined flow == a plain generate -> score -> train -> push loop."""
    from grpoflow.flows.training.data import load_rows, rows_for_step
    from grpoflow.flows.training.runs import RunState, build_learner, rollout_job
    from grpoflow.flows.training.train import grpo_train
    from grpoflow.tasks.advantages import assign_advantages
    from grpoflow.tasks.push.push import weight_push
    from grpoflow.tasks.rollouts.replicas import Replica, ReplicaSet
    from grpoflow.tasks.steps import persist, push_weights, rollout_batch, update

    steps = 3
    sets = {"run.steps": steps, "algorithm.max_staleness": 0, "run.run_id": "flow0"}
    cfg = tiny_cfg(tmp_path / "a", tiny_model_dir, vllm_server.url, **sets)
    grpo_train(config=cfg)
    flow_losses = _losses(tmp_path / "a", "flow0")

    # The plain loop, no Prefect futures and no lookahead: each task's own function (`.fn`).
    run = RunState("plain", 0, 0, str(tiny_model_dir), str(tiny_model_dir), None, False)
    learner = build_learner(cfg, run)
    servers = ReplicaSet([Replica(0, vllm_server.url)])  # the push flips its version
    root = str(tmp_path / "b")
    pusher = weight_push(root, "plain", cfg.sync, cfg.inference)
    push_weights.fn(learner, 0, pusher, servers)
    job = rollout_job(cfg, servers, str(tiny_model_dir))
    rows, plain_losses = load_rows(cfg), []
    for step in range(steps):
        batch_rows, cursor = rows_for_step(
            rows, step, cfg.data.prompts_per_step, seed=cfg.run.seed, shuffle=cfg.data.shuffle
        )
        batch = rollout_batch.fn(step, batch_rows, cursor, job)
        assign_advantages(batch.groups, step=step, algorithm=cfg.algorithm)
        persist.fn(root, "plain", step, batch.groups)
        plain_losses.append(update(learner, batch.groups)["train/loss"])
        assert push_weights.fn(learner, step + 1, pusher, servers).failed_servers == 0
    assert flow_losses == pytest.approx(plain_losses, rel=1e-5, abs=1e-7)


# SIGKILL at each named point of a step (tests/drill.py: KILL_DRILL), in turn: the first launch is killed
# at the first point, its --resume at the second, and so on; the last --resume finishes the run.
# benchmarks/faults.py kills a fresh run at each point instead (six runs: 4 minutes here against 1.5).


@pytest.mark.slow
def test_sigkill_at_each_point_in_turn_then_resume_has_every_step_once(
    tmp_path, vllm_server, tiny_model_dir, prefect_api
):
    """SIGKILL the training process at each named point, resuming after each; every table then has each
    step once, checkpoints are whole, and the data cursor and policy version continue."""
    from prefect.settings import PREFECT_API_URL

    # a launch is killed within its first 4 steps (checkpoint_done@2: the second checkpoint's)
    steps, per_step, run_id = 4 * len(KILL_DRILL) + 2, 8, "killme"
    sets = [
        f"storage.root={tmp_path}",
        f"model.path={tiny_model_dir}",
        f"inference.url={vllm_server.url}",
        *KILL_DRILL_SETS,
        f"run.steps={steps}",
    ]
    env = dict(os.environ, PREFECT_API_URL=str(PREFECT_API_URL.value()))
    set_args = [a for s in sets for a in ("--set", s)]
    first = [sys.executable, "-m", "grpoflow.flows.cli.main", "train", "--run-id", run_id, *set_args]
    again = [sys.executable, "-m", "grpoflow.flows.cli.main", "train", "--resume", run_id, *set_args]
    stored = []  # steps stored after each kill
    try:
        for i, (point, spec) in enumerate(KILL_DRILL.items()):
            killed = subprocess.run(
                again if i else first, cwd=REPO, env={**env, "GRPOFLOW_FAULTS": spec},
                capture_output=True, text=True, timeout=600,
            )  # fmt: skip
            assert killed.returncode == -signal.SIGKILL, (
                point,
                killed.stdout[-3000:] + killed.stderr[-3000:],
            )
            stored.append(len(step_files(tmp_path, "steps", run_id)))
            # the status tells the truth after every kill: never `running` with a dead owner
            meta = json.loads((tmp_path / "runs" / f"{run_id}.json").read_text())
            assert run_status(meta) == "interrupted", (point, meta)
            # what a reader sees right after the crash is whole steps only
            _, rows = query(tmp_path, "SELECT step, count(*) FROM rollouts GROUP BY step")
            assert all(n == per_step * 8 for _, n in rows), point
        assert stored[-1] < steps
        resumed = subprocess.run(again, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
        assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
        assert not _paused(vllm_server.url)  # a kill mid-push left it paused: a resumed run released it
    finally:  # a kill at weight_push leaves the shared server paused; later tests need it serving
        unpause(vllm_server.url)
    assert stored == sorted(stored)  # every launch kept what the ones before it stored
    assert store_check(tmp_path, run_id, steps, per_step * 8) == clean_store(steps)
    for table in ("rollouts", "rewards", "steps"):
        assert step_files(tmp_path, table, run_id) == list(range(steps)), table
        leftovers = list((tmp_path / table / f"run_id={run_id}").glob(".*"))
        assert not leftovers, leftovers  # the killed writers' temp files were swept
    _, rows = query(
        tmp_path,
        "SELECT step, count(*), count(DISTINCT group_id), min(prompt_index), "
        "max(prompt_index) FROM rollouts GROUP BY step ORDER BY step",
    )
    for step, n, groups, lo, hi in rows:
        assert groups == per_step and n == per_step * 8
        # the data cursor continues exactly: step s trains rows s*per_step .. s*per_step+per_step-1
        assert (lo, hi) == (step * per_step, step * per_step + per_step - 1)
    _, rows = query(tmp_path, "SELECT count(*), count(DISTINCT (group_id, sample_index)) FROM rewards")
    assert rows[0] == (steps * per_step * 8, steps * per_step * 8)  # one reward cell per completion
    # the policy version continues: one push per step, so step s trains version s -> s+1
    _, vrows = query(tmp_path, "SELECT step, policy_version FROM steps ORDER BY step")
    assert [v for _, v in vrows] == [s + 1 for s in range(steps)]
    # checkpoints are whole: published ones load, no temp dir is left
    from safetensors import safe_open

    from grpoflow.storage.checkpoints import CheckpointStore

    ckpts = CheckpointStore(tmp_path)
    assert ckpts.list(run_id) == [steps - 3, steps - 1]  # keep_checkpoints=2 of steps 1, 3, 5, ...
    for n in ckpts.list(run_id):
        d = ckpts.dirs.path(run_id, n)
        assert CheckpointStore.load_state(d)["step"] == n
        with safe_open(str(d / "model" / "model.safetensors"), "pt") as f:
            assert len(list(f.keys())) > 0
        assert (d / "trainer_state.pt").stat().st_size > 0
    assert not [p for p in (tmp_path / "checkpoints" / run_id).iterdir() if p.name.startswith(".")]


def _paused(url: str) -> bool:
    import asyncio

    from grpoflow.tasks.rollouts.inference import VLLMClient

    async def go():
        async with VLLMClient(url) as c:
            return await c.is_paused()

    return asyncio.run(go())

"""Crash safety at any point: SIGKILLs of the run process at seeded random failpoints (tests/drill.py),
and a killed run's servers (embedded vLLM with its engine, Prefect's temporary API) dying with it."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys

import pytest

from grpoflow.storage.processes import alive, group_members, guarded_children, kill_tree
from grpoflow.storage.sql import run_status
from tests.drill import clean_store, random_kill_drill, store_check
from tests.support import REPO, unpause, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def test_a_kill_inside_a_compaction_then_resume_leaves_every_table_exactly_once(
    tmp_path, vllm_server, tiny_model_dir, prefect_api
):
    """A kill inside the background compaction that follows a checkpoint (`compact_write`): the one
    point of a real run no other drill kills. The named drill (test_train_flow.py) kills at generation,
    scoring, a Parquet write, a weight push and both checkpoint points, with the same checks of the
    status after each kill and of the store at the end; the random drill with every point and many kills
    is benchmarks/faults.py's."""
    from prefect.settings import PREFECT_API_URL

    steps, per_step = 4, 8 * 8
    sets = [
        f"model.path={tiny_model_dir}",
        f"inference.url={vllm_server.url}",
        f"run.steps={steps}",
        "run.checkpoint_every=2",
        "algorithm.max_staleness=1",
        "storage.compact_every=2",  # a background compaction after every checkpoint: kills land in them too
    ]
    try:
        # seed 4 plans compact_write@1: the compaction after the first checkpoint
        fig = random_kill_drill(
            tmp_path, "drill", sets, kills=1, seed=4, env={"PREFECT_API_URL": str(PREFECT_API_URL.value())}
        )
    finally:  # a kill mid-push leaves the shared server paused; later tests need it serving
        unpause(vllm_server.url)
    # The planned (point, hit) was reached and killed its launch, as the store's kill record says.
    assert fig["planned"] == ["compact_write@1"] and fig["exit_codes"] == [-signal.SIGKILL], fig
    assert fig["fired"] == [[p] for p in fig["planned"]], fig
    assert fig["steps_rows_after_kill"][0] >= 2  # compact_write@1 came after the first checkpoint's steps
    assert fig["completed"], fig["final_output"]
    assert fig["orphans"] == 0, fig
    # The status tells the truth after the kill: never `running` with a dead owner.
    assert fig["statuses_after_kill"] == ["interrupted"], fig
    check = store_check(tmp_path, "drill", steps, per_step)
    assert check == clean_store(steps), (check, fig)


def test_a_sigkilled_run_leaves_no_process_behind_and_resumes(tmp_path, tiny_model_dir, vllm_server):
    """No PREFECT_API_URL and no inference.url: the run starts Prefect's temporary API server and an
    embedded vLLM server (API process + engine). SIGKILL the run once both are up: every one of them
    is gone within seconds. Then the run resumes."""
    env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}
    env["PREFECT_HOME"] = str(tmp_path / "prefect-home")
    sets = [f"storage.root={tmp_path}", f"model.path={tiny_model_dir}", "run.steps=50"]
    set_args = [a for s in sets for a in ("--set", s)]
    cmd = [sys.executable, "-m", "grpoflow.flows.cli.main", "train", "--run-id", "orphan", *set_args]
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    pid_file = tmp_path / "pids" / "vllm-orphan.json"
    seen: list[int] = []

    def servers_up() -> bool:
        nonlocal seen
        assert proc.poll() is None, proc.stderr.read().decode()[-3000:]
        seen = guarded_children(proc.pid)
        vllm = json.loads(pid_file.read_text())["pid"] if pid_file.is_file() else None
        # both guarded servers up, and vLLM's engine process spawned into its group
        return bool(vllm) and len(group_members(vllm)) >= 2 and len([p for p in seen if p != vllm]) >= 1

    try:
        wait_for(servers_up, 300, "the run's Prefect API and vLLM server with its engine", interval_s=0.5)
        seen = guarded_children(proc.pid)
        assert len(seen) >= 3, seen  # Prefect API, vLLM API server, vLLM engine
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        # A SIGKILLed process is still listed while the kernel tears it down (its argv already empty, so
        # no longer "guarded"): wait for every process seen, not only for the guards' argv to go.
        left = lambda: [p for p in seen if alive(p)] + guarded_children(proc.pid)  # noqa: E731
        wait_for(lambda: not left(), 15, "the killed run's servers to go", why=lambda: f"left: {left()}")
    finally:
        kill_tree(seen)
        if proc.poll() is None:
            proc.kill()
    meta = json.loads((tmp_path / "runs" / "orphan.json").read_text())
    assert run_status(meta) == "interrupted"
    resume = [sys.executable, "-m", "grpoflow.flows.cli.main", "train", "--resume", "orphan", *set_args]
    resume += ["--set", f"inference.url={vllm_server.url}", "--set", "run.steps=2"]
    out = subprocess.run(resume, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert not pid_file.exists()  # the dead attempt's record was checked and cleared
    assert run_status(json.loads((tmp_path / "runs" / "orphan.json").read_text())) == "completed"


def test_a_pause_left_by_a_dead_trainer_is_released_only_after_its_lease(vllm_server):
    """policy-server's supervision step on the real server: a trainer's pause within its lease is left
    alone (a reload in progress); once the lease runs out the server is resumed and serves again."""
    from grpoflow.tasks.push.push import release_abandoned_pause
    from grpoflow.tasks.rollouts.inference import VLLMClient

    def on_server(call):
        async def go():
            async with VLLMClient(vllm_server.url) as c:
                return await call(c)

        return asyncio.run(go())

    on_server(lambda c: c.pause(mode="keep", owner="dead-run@host:1", lease_s=1.5))
    try:
        assert on_server(release_abandoned_pause) is None  # within its lease: left alone
        assert on_server(lambda c: c.is_paused()) is True
        released = wait_for(lambda: on_server(release_abandoned_pause), 10, "the 1.5 s lease to run out")
        assert released == "dead-run@host:1" and on_server(lambda c: c.is_paused()) is False
        (ch,) = on_server(lambda c: c.complete([1, 2, 3], max_tokens=2, temperature=0.0))
        assert len(ch.token_ids) >= 1
    finally:
        unpause(vllm_server.url)

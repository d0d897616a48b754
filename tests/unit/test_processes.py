"""Processes a run starts die with it (SIGKILL included); stale ones are found by a verified identity."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from storage.processes import identity, is_alive, record_process, stop_stale
from storage.sql import run_status

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]
GUARD = REPO / "flows" / "vllm_plugins" / "grpoflow_guard.py"


def gone(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return True
    return state in ("Z", "X")  # a zombie holds nothing but its exit status


def wait_gone(pids, timeout_s=10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if all(gone(p) for p in pids):
            return True
        time.sleep(0.1)
    return False


def _pids(path: Path, timeout_s: float = 20.0) -> list[int]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if path.is_file() and path.read_text().strip():
            return [int(x) for x in path.read_text().split()]
        time.sleep(0.05)
    raise AssertionError("the guarded process never started")


def test_a_guarded_server_and_its_children_die_with_a_sigkilled_parent(tmp_path):
    pid_file = tmp_path / "pids"
    # The "run": starts the guarded "server" in its own session from a short-lived thread (as runs
    # start servers from task threads), then waits to be killed.
    run = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import os, subprocess, sys, threading, time\n"
            "t = threading.Thread(target=lambda: subprocess.Popen([sys.executable, sys.argv[1], "
            "str(os.getpid()), 'tests.unit.sleeper', sys.argv[2]], start_new_session=True))\n"
            "t.start(); t.join(); time.sleep(600)",
            str(GUARD),
            str(pid_file),
        ],
        cwd=REPO,
        env=dict(os.environ, PYTHONPATH=str(REPO)),
    )
    server, engine = _pids(pid_file)
    try:
        time.sleep(1.0)  # the spawning thread is long gone: the server must still be up
        assert not gone(server) and not gone(engine)
        run.send_signal(signal.SIGKILL)
        run.wait(10)
        assert wait_gone([server, engine], 10.0), "the server outlived the run"
    finally:
        for p in (server, engine):
            with contextlib.suppress(ProcessLookupError):
                os.kill(p, signal.SIGKILL)


def test_identity_tells_a_live_process_from_a_dead_one_with_the_same_pid():
    me = identity()
    assert is_alive(me) is True
    assert is_alive({**me, "start_time": me["start_time"] + 1}) is False  # the pid was reused
    assert is_alive({**me, "host": "elsewhere"}) is None  # cannot be told from here
    assert is_alive(None) is None


def test_stop_stale_stops_only_a_verified_group_whose_owner_is_dead(tmp_path):
    server = subprocess.Popen(["sleep", "600"], start_new_session=True)
    dead_owner = subprocess.Popen(["true"])
    dead_owner.wait()
    try:
        record_process(tmp_path, "vllm-r", server.pid)
        assert stop_stale(tmp_path, "vllm-r") is False  # its owner (this test) is alive
        assert not gone(server.pid)
        path = tmp_path / "pids" / "vllm-r.json"
        rec = json.loads(path.read_text())
        rec["owner"] = identity(dead_owner.pid) | {"start_time": 1}
        path.write_text(json.dumps({**rec, "start_time": rec["start_time"] + 1}))
        assert stop_stale(tmp_path, "vllm-r") is False  # identity mismatch: never signalled
        assert not gone(server.pid) and not path.exists()
        record_process(tmp_path, "vllm-r", server.pid)
        rec = json.loads(path.read_text())
        path.write_text(json.dumps({**rec, "owner": rec["owner"] | {"start_time": -1}}))
        assert stop_stale(tmp_path, "vllm-r") is True
        server.wait(10)
        assert not path.exists()
    finally:
        server.kill()


def test_a_running_run_whose_owner_died_reads_as_interrupted():
    dead = subprocess.Popen(["true"])
    dead.wait()
    owner = identity(dead.pid) | {"start_time": -1}
    assert run_status({"status": "running", "owner": owner}) == "interrupted"
    assert run_status({"status": "running", "owner": identity()}) == "running"
    assert run_status({"status": "running", "owner": {**identity(), "host": "elsewhere"}}) == "running"
    assert run_status({"status": "completed", "owner": owner}) == "completed"


def test_a_reward_worker_stuck_in_a_hung_reward_dies_with_its_run(tmp_path):
    """A process-pool reward that hangs, in a run that is then SIGKILLed: the worker goes too."""
    pid_file = tmp_path / "worker"
    code = f"""
import asyncio, os
from tasks.config import RewardConfig
from tasks.score import score_groups, _process_pool
from storage.records import RolloutCompletion, RolloutGroup
pool = _process_pool()
pids = pool.submit(os.getpid).result(), pool.submit(os.getpid).result()
open({str(pid_file)!r}, "w").write(" ".join(str(p) for p in sorted(set(pids))))
g = RolloutGroup("g", 0, "p", [1], [RolloutCompletion(0, "a", [1], [1], [-1.0])])
score_groups([g], [RewardConfig(name="stuck", fn="tests.unit.reward_fns:hang_forever", executor="process",
                              timeout_s=600, kwargs={{"pid_dir": {str(tmp_path)!r}}})])
"""
    run = subprocess.Popen([sys.executable, "-c", code], cwd=REPO, env=dict(os.environ, PYTHONPATH=str(REPO)))
    workers = _pids(pid_file, 60)
    try:
        time.sleep(1.0)
        assert not any(gone(p) for p in workers)
        run.send_signal(signal.SIGKILL)
        run.wait(10)
        assert wait_gone(workers, 10.0), "a pool worker outlived the run"
    finally:
        for p in workers:
            with contextlib.suppress(ProcessLookupError):
                os.kill(p, signal.SIGKILL)

"""Processes a run starts die with it, SIGKILL included: a guarded server with its child, and a
process-pool reward worker stuck in a hung reward. No vLLM server: integration because these start
process trees and SIGKILL them (tests/unit runs no servers)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys

import psutil
import pytest

from grpoflow.server import guard
from grpoflow.server.protocol import OWNED_TMPDIR_ENV
from grpoflow.storage.processes import alive, guarded
from tests.support import REPO, wait_for

pytestmark = pytest.mark.integration


def _pids(path, timeout_s: float) -> list[int]:
    text = wait_for(lambda: path.is_file() and path.read_text().strip(), timeout_s, f"pids in {path.name}")
    return [int(x) for x in text.split()]


def test_a_guarded_server_and_its_children_die_with_a_sigkilled_parent(tmp_path):
    pid_file = tmp_path / "pids"
    own_tmp = tmp_path / "server-tmp"  # a vLLM server's own socket folder (flows/processes/serve.py)
    own_tmp.mkdir()
    (own_tmp / "socket-or-init-file").write_text("x")
    # The "run": starts the guarded "server" in its own session from a short-lived thread (as runs
    # start servers from task threads), then waits to be killed.
    run = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import os, subprocess, sys, threading, time\n"
            "from grpoflow.server import guard\n"
            "argv = guard.command(sys.executable, os.getpid(), 'tests.integration.sleeper', [sys.argv[1]])\n"
            "t = threading.Thread(target=lambda: subprocess.Popen(argv, start_new_session=True))\n"
            "t.start(); t.join(); time.sleep(600)",
            str(pid_file),
        ],
        cwd=REPO,
        env=dict(os.environ, PYTHONPATH=str(REPO), **{OWNED_TMPDIR_ENV: str(own_tmp)}),
    )
    server, engine = _pids(pid_file, 20)
    try:
        # A death signal tied to the spawning thread (PR_SET_PDEATHSIG) would fire as it exits.
        wait_for(lambda: psutil.Process(run.pid).num_threads() == 1, 10, "the spawning thread to exit")
        assert alive(server) and alive(engine)
        assert (server, run.pid) in guarded()  # found by its command line (`python -m` the guard)
        assert psutil.Process(server).cmdline()[1:3] == ["-m", guard.MODULE]
        run.send_signal(signal.SIGKILL)
        run.wait(10)
        wait_for(lambda: not alive(server) and not alive(engine), 10, "the server to die with the run")
        assert not own_tmp.exists()  # its guard removed the folder it was given before the kill
    finally:
        for p in (server, engine):
            with contextlib.suppress(ProcessLookupError):
                os.kill(p, signal.SIGKILL)


def test_a_reward_worker_stuck_in_a_hung_reward_dies_with_its_run(tmp_path):
    """A process-pool reward that hangs, in a run that is then SIGKILLed: the worker goes too."""
    pid_file = tmp_path / "worker"
    code = f"""
import asyncio, os
from grpoflow.tasks.config.rewards import RewardConfig
from grpoflow.tasks.rewards.process_pool import process_pool
from grpoflow.tasks.rewards.score import score_groups
from grpoflow.storage.records import RolloutCompletion, RolloutGroup
pool = process_pool()
pids = pool.submit(os.getpid).result(), pool.submit(os.getpid).result()
open({str(pid_file)!r}, "w").write(" ".join(str(p) for p in sorted(set(pids))))
g = RolloutGroup("g", 0, "p", [1], [RolloutCompletion(0, "a", [1], [1], [-1.0])])
score_groups([g], [RewardConfig(name="stuck", fn="tests.unit.reward_fns:hang_forever", executor="process",
                              timeout_s=600, kwargs={{"pid_dir": {str(tmp_path)!r}}})])
"""
    run = subprocess.Popen([sys.executable, "-c", code], cwd=REPO, env=dict(os.environ, PYTHONPATH=str(REPO)))
    workers = _pids(pid_file, 60)
    try:
        # hang_forever leaves its worker's pid in tmp_path: the run is stuck in it now
        wait_for(lambda: any((tmp_path / str(p)).exists() for p in workers), 60, "the reward to hang")
        assert all(alive(p) for p in workers)
        run.send_signal(signal.SIGKILL)
        run.wait(10)
        wait_for(lambda: not any(alive(p) for p in workers), 10, "the pool workers to die with the run")
    finally:
        for p in workers:
            with contextlib.suppress(ProcessLookupError):
                os.kill(p, signal.SIGKILL)

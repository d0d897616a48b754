"""Reading processes (alive, group, session, CPU seconds) and identities: a stale server is found by a
verified identity and stopped only when its owner is dead. What dies with a SIGKILLed run is
tests/integration/test_guard.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from grpoflow.storage.processes import (
    alive,
    cpu_seconds,
    group_members,
    identity,
    is_alive,
    kill_tree,
    processes,
    record_process,
    session_pids,
    stop_stale,
)
from grpoflow.storage.sql import run_status
from tests.support import wait_for

pytestmark = pytest.mark.unit


def test_a_process_group_is_read_whole_and_killed_whole():
    leader = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import subprocess, time; subprocess.Popen(['sleep', '600']); time.sleep(600)",
        ],
        start_new_session=True,
    )
    try:
        members = wait_for(lambda: len(group_members(leader.pid)) == 2 and group_members(leader.pid), 20,
                           "the leader's child")  # fmt: skip
        assert leader.pid in members and session_pids(leader.pid) == members
        [me] = [p for p in processes() if p.pid == os.getpid()]
        assert (me.ppid, me.pgid, me.sid) == (os.getppid(), os.getpgrp(), os.getsid(0))
        assert me.argv[0] == sys.executable or me.argv[0].endswith(("python", "pytest"))
        assert cpu_seconds(os.getpid(), tree=True) >= cpu_seconds(os.getpid()) > 0.0
        kill_tree([leader.pid])
        leader.wait(10)
        wait_for(lambda: not any(alive(p) for p in members), 10, "the group to die")
        assert group_members(leader.pid) == [] and cpu_seconds(leader.pid) == 0.0
    finally:
        kill_tree([leader.pid])
        leader.wait(10)


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
        assert alive(server.pid)
        path = tmp_path / "pids" / "vllm-r.json"
        rec = json.loads(path.read_text())
        rec["owner"] = identity(dead_owner.pid) | {"start_time": 1}
        path.write_text(json.dumps({**rec, "start_time": rec["start_time"] + 1}))
        assert stop_stale(tmp_path, "vllm-r") is False  # identity mismatch: never signalled
        assert alive(server.pid) and not path.exists()
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

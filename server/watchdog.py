"""A process that dies with its parent: `watch_parent`, and the reading of the process table it needs.

The guard (guard.py) runs it in every server grpoflow starts, the process-pool reward workers too
(through grpoflow.storage.processes, which re-exports these names beside the rest of its process
handling). Standard library and psutil only: it runs in the vLLM environment as well as grpoflow's.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import threading
import time
from collections.abc import Iterator
from typing import NamedTuple

import psutil


class Proc(NamedTuple):
    pid: int
    ppid: int
    pgid: int
    sid: int
    cpu_seconds: float  # user + system, all its threads
    argv: list[str]


def processes() -> Iterator[Proc]:
    """Every live process this user can read; zombies left out (a zombie holds nothing but its exit
    status)."""
    for p in psutil.process_iter(["ppid", "status", "cmdline", "cpu_times"]):
        info = p.info
        if info["status"] in (psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD, None) or info["cpu_times"] is None:
            continue
        try:
            pgid, sid = os.getpgid(p.pid), os.getsid(p.pid)
        except OSError:  # gone meanwhile
            continue
        times = info["cpu_times"]
        yield Proc(p.pid, info["ppid"], pgid, sid, times.user + times.system, info["cmdline"] or [])


def session_pids(sid: int) -> list[int]:
    """Live processes of session `sid`."""
    return [p.pid for p in processes() if p.sid == sid]


def watch_parent(
    parent_pid: int, interval_s: float = 0.5, whole_session: bool = False, remove: str | None = None
) -> None:
    """Start a daemon thread that SIGKILLs this process once `parent_pid` is no longer its parent (this
    process was re-parented: its parent died, maybe by SIGKILL or the OOM killer, which run no cleanup
    code), with its process group when it leads one, so that what it spawned goes too. With
    `whole_session` (and this process leading its session) every process of the session goes first:
    Ray's raylet puts each worker in a process group of its own, inside the session. `remove`: a
    folder that goes before the kill (a server's own temporary folder, which nobody else would remove).

    `PR_SET_PDEATHSIG` is not used: it fires when the *thread* that spawned the child exits, and runs
    start servers from short-lived task threads."""

    def loop() -> None:
        while os.getppid() == parent_pid:
            time.sleep(interval_s)
        me = os.getpid()
        if remove:
            shutil.rmtree(remove, ignore_errors=True)
        if whole_session and os.getsid(0) == me:
            for pid in session_pids(me):
                if pid != me:
                    with contextlib.suppress(OSError):
                        os.kill(pid, signal.SIGKILL)
        if os.getpgrp() == me:
            os.killpg(me, signal.SIGKILL)
        os.kill(me, signal.SIGKILL)

    threading.Thread(target=loop, name="grpoflow-parent-watchdog", daemon=True).start()

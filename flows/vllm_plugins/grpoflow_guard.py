"""Run a Python module as `__main__`, and die with the process that started it.

    python grpoflow_guard.py PARENT_PID MODULE [ARGS...]

Servers a run starts (the vLLM server with its engine and workers, Prefect's API server) must not
outlive the run, however the run dies: SIGKILL and the OOM killer run no cleanup code. A watchdog
thread here notices that the parent is gone (this process was re-parented) and kills this process's
whole process group: the caller starts it as a group leader, so the engine and worker processes the
module spawns go with it. `PR_SET_PDEATHSIG` is not used: it fires when the *thread* that spawned
the child exits, and runs start servers from short-lived task threads.

Standard library only: it runs in the vLLM environment as well as grpoflow's.
"""

from __future__ import annotations

import contextlib
import os
import runpy
import signal
import sys
import threading
import time


def session_pids(sid: int) -> list[int]:
    """Live processes of session `sid` (Linux /proc), zombies left out."""
    out = []
    for name in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{name}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2 :].split()  # after the command name, which may hold spaces
        if fields[0] != "Z" and int(fields[3]) == sid:
            out.append(int(name))
    return out


def watch_parent(parent_pid: int, interval_s: float = 0.5) -> None:
    """Start a daemon thread that kills this process (and its group, if it leads one) once
    `parent_pid` is no longer its parent. With GRPOFLOW_GUARD_SESSION=1 it kills its whole session
    first: Ray's raylet puts each worker in a process group of its own, inside this session."""

    def loop() -> None:
        while os.getppid() == parent_pid:
            time.sleep(interval_s)
        if os.environ.get("GRPOFLOW_GUARD_SESSION") == "1" and os.getsid(0) == os.getpid():
            for pid in session_pids(os.getpid()):
                if pid != os.getpid():
                    with contextlib.suppress(OSError):
                        os.kill(pid, signal.SIGKILL)
        if os.getpgrp() == os.getpid():
            os.killpg(os.getpid(), signal.SIGKILL)
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=loop, name="grpoflow-parent-watchdog", daemon=True).start()


def main() -> None:
    if len(sys.argv) < 3:
        sys.exit("usage: grpoflow_guard.py PARENT_PID MODULE [ARGS...]")
    watch_parent(int(sys.argv[1]))
    module = sys.argv[2]
    sys.argv = [module, *sys.argv[3:]]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()

"""Processes: the one place that reads them (alive, parent, group, session, CPU seconds, argv), kills
what a failure left over, watches a parent, and records which process owns what in the store.

A pid alone says nothing once its process is gone (pids are reused), so an identity is (host, boot id,
pid, the kernel's start time of that pid). A process is "dead" only when it is on this host and no
process with that pid and start time exists; on another host we cannot tell, and say so. No signal is
ever sent to a pid whose identity does not match.

The watchdog that makes a process die with its parent, and the reading of the process table it needs
(`Proc`, `processes`, `session_pids`, `watch_parent`), live in grpoflow.server.watchdog: the guard runs
it inside the vLLM environment, which has grpoflow.server installed and nothing else of grpoflow. They
are re-exported here, the one place the rest of grpoflow reads processes from.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import time
from pathlib import Path
from typing import Any

import psutil

from grpoflow.server.guard import watched_parent
from grpoflow.server.watchdog import Proc, processes, session_pids, watch_parent  # noqa: F401 (module doc)
from grpoflow.storage.rollouts import atomic_write_text

# -- reading processes ----------------------------------------------------------------------------


def alive(pid: int) -> bool:
    """A process that exists and is not a zombie."""
    try:
        return psutil.Process(pid).status() not in (psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD)
    except psutil.Error:
        return False


def group_members(pgid: int) -> list[int]:
    """Live processes of process group `pgid`."""
    return [p.pid for p in processes() if p.pgid == pgid]


def cpu_seconds(pid: int, *, tree: bool = False) -> float:
    """User + system CPU seconds of `pid` (all its threads), with its live descendants' when `tree`;
    0.0 once it is gone."""
    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)] if tree else [root]
    except psutil.Error:
        return 0.0
    total = 0.0
    for p in procs:
        with contextlib.suppress(psutil.Error):
            times = p.cpu_times()
            total += times.user + times.system
    return total


def guarded() -> list[tuple[int, int]]:
    """(pid, parent pid it watches) of every live process started under grpoflow's guard."""
    return [(p.pid, parent) for p in processes() if (parent := watched_parent(p.argv)) is not None]


def guarded_children(parent_pid: int) -> list[int]:
    """Live processes started under grpoflow's guard by `parent_pid`, and their process groups."""
    leaders = [pid for pid, parent in guarded() if parent == parent_pid]
    return sorted({*leaders, *(p for g in leaders for p in group_members(g))})


# -- ending processes -----------------------------------------------------------------------------


def kill_tree(pids: list[int]) -> None:
    """Last-resort cleanup (tests' teardown, drills): SIGKILL each pid and the group it leads, so a
    failure leaks nothing."""
    for p in pids:
        if p <= 0:  # kill(0 or -1) would signal this process's group or every process
            continue
        for fn in (os.killpg, os.kill):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                fn(p, signal.SIGKILL)


# -- identities and pid files ---------------------------------------------------------------------


def _boot_id() -> str:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


def _start_time(pid: int) -> int | None:
    """The kernel's start time of `pid` (clock ticks since boot), None if no such process.

    Read from /proc, not psutil: identities already stored hold these ticks, and psutil gives seconds
    since the epoch, offset by a boot time the kernel recomputes from the wall clock."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat[stat.rindex(")") + 2 :].split()[19])  # field 22; comm may contain spaces


def identity(pid: int | None = None) -> dict[str, Any]:
    pid = os.getpid() if pid is None else pid
    return {"host": socket.gethostname(), "boot_id": _boot_id(), "pid": pid, "start_time": _start_time(pid)}


def is_alive(ident: dict[str, Any] | None) -> bool | None:
    """True/False for a process of this host (and boot); None when it cannot be told from here."""
    if not ident or ident.get("host") != socket.gethostname():
        return None
    if ident.get("boot_id") != _boot_id():
        return False  # the machine rebooted since: nothing of that process survives
    started = _start_time(int(ident["pid"]))
    return started is not None and started == ident.get("start_time")


def _pid_file(root: str | Path, name: str) -> Path:
    return Path(root) / "pids" / f"{name}.json"


def record_process(root: str | Path, name: str, pid: int, **extra: Any) -> None:
    """Write `<root>/pids/<name>.json` for a process this run started (a group leader)."""
    path = _pid_file(root, name)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, json.dumps({**identity(pid), "owner": identity(), **extra}, indent=2))


def forget_process(root: str | Path, name: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        _pid_file(root, name).unlink()


def stop_stale(root: str | Path, name: str, grace_s: float = 10.0) -> bool:
    """Stop the process group recorded as `name` if it is still running and its owner is dead.

    Returns True if something was stopped. A record whose process is gone is removed; one whose owner
    still lives (another run using it) is left alone."""
    path = _pid_file(root, name)
    try:
        rec = json.loads(path.read_text())
    except (OSError, ValueError):
        return False
    alive_now = is_alive(rec)
    if alive_now is not True:
        if alive_now is False:
            forget_process(root, name)
        return False
    if is_alive(rec.get("owner")) is not False:
        return False  # its owner lives (or is on another host): not ours to stop
    pid = int(rec["pid"])
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and is_alive(rec):
        time.sleep(0.2)
    if is_alive(rec):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, signal.SIGKILL)
    forget_process(root, name)
    return True

"""Which process owns what in the store: identities in run metadata and pid files under `<root>/pids/`.

A pid alone says nothing once its process is gone (pids are reused), so an identity is (host, boot id,
pid, the kernel's start time of that pid). A process is "dead" only when it is on this host and no
process with that pid and start time exists; on another host we cannot tell, and say so. No signal is
ever sent to a pid whose identity does not match.
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

from storage.rollouts import atomic_write_text


def _boot_id() -> str:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


def _start_time(pid: int) -> int | None:
    """The kernel's start time of `pid` (clock ticks since boot), None if no such process."""
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
    alive = is_alive(rec)
    if alive is not True:
        if alive is False:
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

"""Server processes grpoflow starts and owns: the vLLM server (flows/processes/serve.py), Prefect's API server
(flows/processes/prefect_api.py) and Ray's head (flows/processes/cluster.py) all start under the guard, wait for their
health check and stop as one process group; the explorer (flows/viewing/ui.py) checks its bind address here.
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import signal
import socket
import subprocess
import threading
import time
import urllib.request
from collections import deque
from pathlib import Path

from grpoflow.server import guard
from grpoflow.storage.processes import forget_process, record_process


class ServerStartError(RuntimeError):
    """The server did not become healthy; the message carries its last log lines."""


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def is_healthy(url: str, timeout_s: float = 2.0) -> bool:
    """GET <url>/health answered 200 (vLLM's and Prefect's API both have one)."""
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=timeout_s) as r:
            return r.status == 200
    except OSError:
        return False


def _tail(path: Path, n: int = 40) -> str:
    try:
        with open(path, errors="replace") as f:
            return "".join(deque(f, maxlen=n))
    except OSError:
        return "<no log>"


def guarded_command(python: str, module: str, args: list[str]) -> list[str]:
    """`python -m module args`, run under the guard (`python -m grpoflow.server.guard`, so `python`'s
    environment must have grpoflow.server installed): its process group is killed once this process
    (the one that builds and starts it) is gone, however it dies."""
    return guard.command(python, os.getpid(), module, args)


def _group_exists(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class ServerHandle:
    """A server process (vLLM, or Prefect's API): start, health-wait, restart, stop (process group)."""

    def __init__(
        self,
        cmd: list[str],
        env: dict[str, str],
        url: str,
        log_path: Path,
        startup_timeout_s: float,
        pid_file: tuple[Path, str] | None = None,
    ):
        self.cmd, self.env, self.url, self.log_path = cmd, env, url, log_path
        self.startup_timeout_s = startup_timeout_s
        self.pid_file = pid_file  # (store root, name): <root>/pids/<name>.json while it runs
        self.proc: subprocess.Popen | None = None
        self.restarts = 0
        # close() and a restart on another thread (a replica's reviver) must not race: once closed,
        # no new process starts.
        self._lock = threading.Lock()
        self.closed = False

    def start(self) -> ServerHandle:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        # A new session: stop() can signal the server and its engine/worker children together, and
        # the guard's watchdog (guarded_command) kills that whole group if this process dies.
        with self._lock:
            if self.closed:
                raise ServerStartError(f"vLLM server at {self.url} was closed; not starting it again")
            with open(self.log_path, "ab") as log:
                self.proc = subprocess.Popen(
                    self.cmd, env=self.env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
                )
            if self.pid_file is not None:
                record_process(*self.pid_file, self.proc.pid, url=self.url)
        self.wait_healthy()
        return self

    def wait_healthy(self) -> None:
        deadline = time.monotonic() + self.startup_timeout_s
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise ServerStartError(
                    f"vLLM server exited with code {self.proc.returncode} during start-up; last log lines "
                    f"({self.log_path}):\n{_tail(self.log_path)}"
                )
            if self.healthy():
                return
            time.sleep(1.0)
        self.stop()
        raise ServerStartError(
            f"vLLM server not healthy after {self.startup_timeout_s:.0f}s at {self.url}; last log lines "
            f"({self.log_path}):\n{_tail(self.log_path)}"
        )

    def healthy(self) -> bool:
        return is_healthy(self.url)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self, grace_s: float = 15.0) -> None:
        """SIGTERM the server's whole process group, then SIGKILL whatever of it is left after
        `grace_s`: the API server (the group's leader) can exit before its engine and worker
        processes, which would otherwise outlive it, re-parented and holding their memory."""
        if self.pid_file is not None:
            forget_process(*self.pid_file)
        if self.proc is None or self.proc.poll() is not None:
            return
        group, deadline = self.proc.pid, time.monotonic() + grace_s
        with contextlib.suppress(ProcessLookupError):
            os.killpg(group, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(grace_s)
        while _group_exists(group) and time.monotonic() < deadline:
            time.sleep(0.2)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(group, signal.SIGKILL)
        self.proc.wait(10)

    def close(self) -> None:
        """Stop the server for good: a restart under way on another thread starts nothing more."""
        with self._lock:
            self.closed = True
        self.stop()

    def kill(self) -> None:
        """SIGKILL the whole server (fault-injection tests)."""
        if self.proc is not None and self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)

    def restart(self) -> None:
        self.stop()
        self.restarts += 1
        self.start()

    def __enter__(self) -> ServerHandle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

"""The Ray cluster that `executor: ray` rewards and tools run on: started for the run, or joined.

`scale.ray_address: local` starts a head node on this machine, `ray start --head --block`, under
grpoflow's guard as the vLLM server is (flows/processes/launch.py): the guard leads a process group that holds
Ray's GCS server, raylet, agents and workers, and kills that group once the run's process is gone,
SIGKILL included. A local head has no dashboard, a capped object store and its own temp folder.
Any other address joins an existing cluster, which a run never stops.

The job's runtime environment carries the code to the workers, the way Ray documents for local and
remote clusters alike: grpoflow's own packages as `py_modules`, and the folder of the user's config
file (their reward and tool modules beside it) as `working_dir`, which Ray puts on the workers'
import path. No PYTHONPATH to set by hand.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import os
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from grpoflow.flows.processes.launch import ServerHandle, free_port, guarded_command
from grpoflow.server.protocol import GUARD_SESSION_ENV
from grpoflow.storage.processes import session_pids
from grpoflow.tasks.config.run import ScaleConfig

REPO = Path(__file__).resolve().parents[2]
PACKAGES = ("tasks", "storage", "examples")  # what workers import: the call wrapper and its imports
# Never uploaded from a config's folder (Ray also skips what its .gitignore lists): stores, models,
# environments; Ray refuses a working_dir over 500 MiB.
EXCLUDES = [".git", ".venv*", "runs", "models", "__pycache__", "*.parquet", "*.safetensors", "*.gguf"]
_STARTED = "Ray runtime started"  # what `ray start` prints once its processes are up


class RayStartError(RuntimeError):
    """A local Ray did not start; the message carries its last log lines."""


class LocalRay(ServerHandle):
    """A head node for one run: GCS, raylet and workers in one guarded process group; `stop()` (or
    the run's death) ends them all."""

    def __init__(self, scale: ScaleConfig, log_path: Path | None = None):
        self.port = free_port()
        # its own temp folder: sessions, sockets and logs of this cluster only (short, for the socket
        # path limit), removed at stop
        self.temp_dir = Path(tempfile.mkdtemp(prefix="grpoflow-ray-"))
        args = [
            "start",
            "--head",
            "--block",
            f"--port={self.port}",
            "--node-ip-address=127.0.0.1",
            "--include-dashboard=false",  # Ray's head process then serves no UI and loads no modules
            "--dashboard-host=127.0.0.1",
            f"--object-store-memory={scale.object_store_mb * 1024 * 1024}",
            f"--temp-dir={self.temp_dir}",
            "--disable-usage-stats",
        ]
        if scale.num_cpus is not None:
            args.append(f"--num-cpus={scale.num_cpus}")
        cmd = guarded_command(sys.executable, "ray.scripts.scripts", args)
        log = log_path or self.temp_dir / "ray-start.log"
        super().__init__(cmd, _env(), f"127.0.0.1:{self.port}", log, scale.startup_timeout_s)
        self.log_offset = 0

    def healthy(self) -> bool:
        try:
            return _STARTED in self.log_path.read_text(errors="replace")[self.log_offset :]
        except OSError:
            return False

    def start(self) -> LocalRay:
        self.log_offset = self.log_path.stat().st_size if self.log_path.exists() else 0
        return super().start()

    def wait_healthy(self) -> None:
        deadline = time.monotonic() + self.startup_timeout_s
        while time.monotonic() < deadline:
            if self.healthy():
                return
            if self.proc is not None and self.proc.poll() is not None:
                raise RayStartError(f"`ray start` exited with code {self.proc.returncode}; {self._tail()}")
            time.sleep(0.2)
        self.stop()
        raise RayStartError(f"Ray not started after {self.startup_timeout_s:.0f}s; {self._tail()}")

    def _tail(self, n: int = 30) -> str:
        lines = self.log_path.read_text(errors="replace")[self.log_offset :].splitlines()[-n:]
        return f"last log lines ({self.log_path}):\n" + "\n".join(lines)

    def stop(self, grace_s: float = 3.0) -> None:
        # A run's Ray keeps nothing worth a long graceful exit: it holds no state the run needs.
        super().stop(grace_s)  # the group: `ray start`, GCS, raylet, agents
        # Workers lead process groups of their own; they exit once their raylet is gone, but one stuck
        # in native code might not, so whatever is left of the session goes too.
        for pid in session_pids(self.proc.pid) if self.proc is not None else []:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        shutil.rmtree(self.temp_dir, ignore_errors=True)


def _env() -> dict[str, str]:
    # GRPOFLOW_GUARD_SESSION: the guard kills the whole session (workers included) if the run dies
    return {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", GUARD_SESSION_ENV: "1"}


@functools.cache
def shipped_packages() -> Path:
    """grpoflow's PACKAGES as one `grpoflow/` folder, Ray's `py_modules` unit: in the repository they are
    top-level folders that pyproject.toml maps under `grpoflow`, and a worker must import them by that
    name. Copied once per process into a temporary folder, removed at exit."""
    tmp = Path(tempfile.mkdtemp(prefix="grpoflow-ray-"))
    atexit.register(shutil.rmtree, tmp, ignore_errors=True)
    for p in PACKAGES:
        shutil.copytree(REPO / p, tmp / "grpoflow" / p, ignore=shutil.ignore_patterns("__pycache__"))
    return tmp / "grpoflow"


def runtime_env(config_dir: str | Path | None) -> dict[str, Any]:
    """What every worker of the run's Ray job gets: grpoflow's packages, and the config's folder."""
    env: dict[str, Any] = {"py_modules": [str(shipped_packages())]}
    if config_dir is not None:
        env["working_dir"] = str(Path(config_dir).resolve())
        env["excludes"] = EXCLUDES
    return env


@dataclass
class RayCluster:
    address: str
    head: LocalRay | None  # the head this run started ('local'), else None


@contextlib.contextmanager
def ray_cluster(
    scale: ScaleConfig, config_dir: str | Path | None = None, log_path: str | Path | None = None
) -> Iterator[RayCluster | None]:
    """Join (or start, for 'local') the run's Ray cluster; yields it, or None without Ray.

    `config_dir`: the folder of the user's config file, shipped to the workers. `log_path`: where a
    local Ray's `ray start` output goes (default: a file in its temp folder)."""
    if scale.ray_address is None:
        yield None
        return
    import ray

    if ray.is_initialized():
        raise RuntimeError(
            "this process is connected to a Ray cluster already; scale.ray_address wants its own"
        )
    head = None
    if scale.ray_address == "local":
        head = LocalRay(scale, Path(log_path) if log_path else None)
    try:
        if head is not None:
            head.start()
        address = head.url if head is not None else scale.ray_address
        ray.init(address=address, runtime_env=runtime_env(config_dir), namespace="grpoflow")
        try:
            yield RayCluster(address, head)
        finally:
            ray.shutdown()
    finally:
        if head is not None:
            head.stop()

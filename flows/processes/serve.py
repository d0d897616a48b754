"""Start, supervise and stop the vLLM server (the long-lived `policy-server` flow: flows/processes/policy_server.py).

A server's command line, environment and served dtype are flows/processes/vllm_command.py's. The process
handling it shares with Prefect's API server and Ray (the guard, health wait, stop by process group) is
flows/processes/launch.py.
"""

from __future__ import annotations

import contextlib
import functools
import os
import shutil
import subprocess
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from grpoflow.flows.processes.launch import ServerHandle
from grpoflow.flows.processes.vllm_command import REPO, cpu_only, server_command
from grpoflow.server.protocol import OWNED_TMPDIR_ENV
from grpoflow.storage.processes import stop_stale
from grpoflow.tasks.config.inference import InferenceConfig
from grpoflow.tasks.config.learner import LoraConfig
from grpoflow.tasks.push.push import forget_server


def core_shares(n: int, cores=None) -> list[frozenset[int]]:
    """This process's cores cut into `n` contiguous shares, one per embedded replica; with fewer cores
    than replicas, replicas share cores round-robin."""
    ids = sorted(cores if cores is not None else os.sched_getaffinity(0))
    if n <= len(ids):
        return [frozenset(ids[i * len(ids) // n : (i + 1) * len(ids) // n]) for i in range(n)]
    return [frozenset({ids[i % len(ids)]}) for i in range(n)]


def upload_dir_of(root: str | Path, name: str) -> Path:
    """Where the server recorded as `<root>/pids/<name>.json` keeps the versions uploaded to it: one
    folder per server name, which only one live server holds at a time (a stale one is stopped first)."""
    return Path(root) / "uploads" / name


@functools.cache
def require_server_package(python: str) -> None:
    """Raise a RuntimeError naming the fix unless `python` (the vLLM environment's) can import
    grpoflow.server: the guard, middlewares and worker extension vLLM is handed live there."""
    probe = subprocess.run([python, "-c", "import grpoflow.server.guard"], capture_output=True, text=True)
    if probe.returncode != 0:
        last = (probe.stderr.strip().splitlines() or ["no output"])[-1]
        raise RuntimeError(
            f"the vLLM environment's python {python} cannot import grpoflow.server ({last}): install it "
            f"there with `{python} -m pip install --no-deps -e {REPO / 'server'}` (`make install` does it "
            "for .venv-vllm)"
        )


# vLLM's IPC socket paths are <VLLM_RPC_BASE_PATH>/<uuid4>: a folder of ours must leave them under
# AF_UNIX's limit.
_SOCKET_PATH_MAX = 107 - 1 - 36


class VLLMServer(ServerHandle):
    """A vLLM server process. Once it stops, what this process loaded into it is forgotten: a server
    started later at its URL serves its own model, never the weights a rollback would reload.

    Each start puts vLLM's IPC sockets in a folder of its own (VLLM_RPC_BASE_PATH; three or four a
    start, which a killed server left in /tmp), removed when it stops or is found dead at a restart; the
    server's guard removes it when the run dies without stopping it. The rest of the server's temporary
    files stay in the system's folder: torch keeps its precompiled C++ headers there (150 MB, built
    once, not at every start)."""

    tmp_dir: Path | None = None

    def start(self) -> ServerHandle:
        require_server_package(self.cmd[0])  # before vLLM starts: its own error comes minutes later
        self._own_tmp()
        try:
            return super().start()
        except BaseException:
            self.stop()  # what a failed start left: engine processes of a dead API server, the folder
            raise

    def stop(self, grace_s: float = 15.0) -> None:
        forget_server(self.url)
        super().stop(grace_s)
        if self.tmp_dir is not None and not self.alive():
            shutil.rmtree(self.tmp_dir, ignore_errors=True)
            self.tmp_dir = None

    def _own_tmp(self) -> None:
        base = tempfile.gettempdir()
        if len(base) + len("/grpoflow-vllm-xxxxxxxx") > _SOCKET_PATH_MAX:
            return  # a long TMPDIR: vLLM's sockets go there as before
        self.tmp_dir = Path(tempfile.mkdtemp(prefix="grpoflow-vllm-", dir=base))
        # OWNED_TMPDIR_ENV: the guard removes it too, when the run dies without stopping the server
        self.env["VLLM_RPC_BASE_PATH"] = self.env[OWNED_TMPDIR_ENV] = str(self.tmp_dir)


def start_server(
    model_dir: str | Path,
    *,
    log_path: str | Path | None = None,
    startup_timeout_s: float = 600.0,
    pid_file: tuple[Path, str] | None = None,
    **kwargs,
) -> ServerHandle:
    """Start a server and wait for /health; raises ServerStartError with the log tail on failure.

    With `pid_file=(root, name)` it is recorded under `<root>/pids/` while it runs (the caller stops a
    stale one of that name first: `storage.processes.stop_stale`), and versions uploaded to it go to
    `<root>/uploads/<name>/` (`upload_dir`: the server of that name owns it)."""
    if pid_file is not None:
        kwargs.setdefault("upload_dir", upload_dir_of(*pid_file))
    cmd, env, url = server_command(model_dir, **kwargs)
    log = Path(log_path) if log_path else Path(model_dir).parent / "vllm-server.log"
    return VLLMServer(cmd, env, url, log, startup_timeout_s, pid_file).start()


@contextlib.contextmanager
def embedded_server(model_dir: str | Path, **kwargs):
    """A server for the duration of a run; stopped on exit, also on failure."""
    kwargs = {k: v for k, v in kwargs.items() if v is not None}
    handle = start_server(model_dir, **kwargs)
    try:
        yield handle
    finally:
        handle.stop()


@dataclass
class Server:
    """The server a run generates on: `handle` is the embedded server's, None for an external URL."""

    url: str
    handle: ServerHandle | None = None


def replica_names(name: str, inference: InferenceConfig) -> list[str]:
    """The pid-file names of a run's embedded servers: `name`, then `name-r1`, `name-r2`, ..."""
    return [name] + [f"{name}-r{i}" for i in range(1, inference.replicas)]


@contextlib.contextmanager
def inference_servers(
    inference: InferenceConfig,
    model_dir: str | Path,
    root: str | Path,
    name: str,
    lora: LoraConfig | None = None,
    dtype: str | None = None,
    spin: bool = False,
):
    """The run's generation servers: `inference.urls` / `inference.url` as they are, or
    `inference.replicas` embedded servers (each on its own share of the cores, started together,
    always stopped, serving `dtype`: `served_dtype`; `spin`: server_command's, for a run whose
    generation and training take turns). Servers a dead attempt of the same names left
    behind are stopped first. With `lora` (a LoRA learner's), embedded servers load adapters of its rank
    (`inference.max_loras` per batch); external ones must have been started so (the first push says so)."""
    root, names = Path(root), replica_names(name, inference)
    for n in names:
        stop_stale(root, n)
    if inference.external():
        yield [Server(url) for url in inference.external()]
        return
    i = inference
    shares = core_shares(len(names)) if len(names) > 1 and cpu_only() else [None] * len(names)
    handles: list[ServerHandle] = []

    def start(n: str, cores) -> ServerHandle:
        log = root / "logs" / f"{n}.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        cmd, env, url = server_command(
            model_dir,
            host=i.host,
            port=i.port if len(names) == 1 else None,
            max_model_len=i.max_model_len,
            kv_cache_gb=i.kv_cache_gb,
            api_key=i.api_key,
            extra_args=tuple(i.extra_args),
            cores=cores,
            lora_rank=lora and lora.served_rank(),
            max_loras=i.max_loras,
            upload_dir=upload_dir_of(root, n),
            dtype=dtype,
            spin=spin,
        )
        handle = VLLMServer(cmd, env, url, log, i.startup_timeout_s, (root, n))
        handles.append(handle)
        return handle.start()

    try:
        with ThreadPoolExecutor(len(names)) as pool:  # start-ups overlap (each is mostly waiting)
            started = list(pool.map(start, names, shares))
        yield [Server(h.url, h) for h in started]
    finally:
        for h in handles:
            h.close()


@contextlib.contextmanager
def inference_server(
    inference: InferenceConfig,
    model_dir: str | Path,
    root: str | Path,
    name: str,
    lora: LoraConfig | None = None,
    dtype: str | None = None,
):
    """`inference.url`, or an embedded vLLM server named `name` under `root` (always stopped; with
    `lora`, one that loads adapters of its rank; serving `dtype`); a server a dead attempt of the same
    name left behind is stopped first."""
    one = inference.model_copy(update={"urls": [], "replicas": 1})
    with inference_servers(one, model_dir, root, name, lora, dtype) as (server,):
        yield server

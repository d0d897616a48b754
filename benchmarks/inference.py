"""Inference benchmark on the real vLLM CPU server.

Prints JSON: generation tokens/s at concurrency 1, 8 and 32 for the tiny model (one 32-token
prompt, or with --prompt-tokens N a prompt of N tokens for each request; 128 new tokens per request,
ignore nothing: EOS may end requests early, so tokens are counted, not assumed), and
weight-push seconds (safetensors save + pause/reload/resume) for the tiny model and, when
`--smollm2 DIR` is given (see `make models/smollm2-135m`), for SmolLM2-135M.

    .venv/bin/python benchmarks/inference.py [--smollm2 models/smollm2-135m] [--prompt-tokens N]
"""

from __future__ import annotations

import sys
from pathlib import Path

# This folder has a storage.py; keep it from shadowing the `storage` package when run as a script.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]

import argparse
import asyncio
import json
import statistics
import tempfile
import time

from grpoflow.flows.processes.serve import start_server
from grpoflow.tasks.config.inference import InferenceConfig, SyncConfig
from grpoflow.tasks.push.push import push_version, weight_push
from grpoflow.tasks.rollouts.inference import VLLMClient
from grpoflow.tasks.rollouts.replicas import Replica, ReplicaSet
from grpoflow.tasks.tiny_model import build_tiny_model


def prompt(i: int, tokens: int | None) -> list[int]:
    """Request i's prompt: one 32-token prompt for all (its prefix cached after the first), or with
    `tokens` a prompt of that length of its own (every token prefilled)."""
    return list(range(10, 42)) if tokens is None else [10 + (i + k * 7) % 90 for k in range(tokens)]


async def throughput(url: str, concurrency: int, requests: int, max_tokens: int, tokens: int | None) -> dict:
    async with VLLMClient(url, max_in_flight=concurrency) as c:
        await c.complete([1, 2, 3, 4], max_tokens=4)  # warm-up
        t0 = time.perf_counter()
        outs = await asyncio.gather(
            *(c.complete(prompt(i, tokens), max_tokens=max_tokens, seed=i) for i in range(requests))
        )
        dt = time.perf_counter() - t0
    tokens = sum(len(o[0].token_ids) for o in outs)
    return {
        "concurrency": concurrency,
        "requests": requests,
        "tokens": tokens,
        "tokens_per_s": round(tokens / dt, 1),
    }


def push_seconds(url: str, model_dir: Path, root: Path, repeats: int = 3) -> dict:
    """The run's push (tasks.push.push_version, sync's defaults: keep_last 2) of a model in this process."""
    from transformers import AutoModelForCausalLM

    from grpoflow.tasks.push.weights import save_weights

    model = AutoModelForCausalLM.from_pretrained(model_dir)
    pusher = weight_push(root, "bench", SyncConfig(), InferenceConfig())
    servers = ReplicaSet([Replica(0, url)])
    totals, saves, loads = [], [], []
    for v in range(repeats):
        stats = push_version(pusher, lambda d: save_weights(model, d), v + 1, servers)
        totals.append(stats.total_seconds)
        saves.append(stats.save_seconds)
        loads.append(stats.reload_seconds)
    params = sum(p.numel() for p in model.parameters())
    return {"params": params, "push_seconds_median": round(statistics.median(totals), 3),
            "save_seconds_median": round(statistics.median(saves), 3),
            "pause_reload_resume_seconds_median": round(statistics.median(loads), 3)}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--smollm2", help="converted SmolLM2-135M model dir")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--prompt-tokens", type=int, help="each request a prompt of its own of this length")
    ap.add_argument("--push-only", action="store_true", help="only the weight-push figures")
    ap.add_argument("--repeats", type=int, default=3, help="pushes per model (median)")
    args = ap.parse_args()
    # the models, versions and logs of one run: 1.1 GB with SmolLM2, removed at the end, also on failure
    with tempfile.TemporaryDirectory(prefix="grpoflow-inf-") as tmp:
        run(args, Path(tmp))


def run(args: argparse.Namespace, root: Path) -> None:
    tiny = build_tiny_model(root / "tiny")
    result: dict = {"model": "tiny (2 layers, hidden 128)"}
    with start_server(tiny, max_model_len=1024, log_path=root / "tiny.log") as server:
        if not args.push_only:
            result["throughput"] = [
                asyncio.run(throughput(server.url, c, max(4, 2 * c), args.max_tokens, args.prompt_tokens))
                for c in (1, 8, 32)
            ]
        result["weight_push_tiny"] = push_seconds(server.url, tiny, root, args.repeats)
    print(json.dumps(result), flush=True)
    if args.smollm2:
        with start_server(
            args.smollm2, max_model_len=1024, kv_cache_gb=2, log_path=root / "smol.log"
        ) as server:
            smol: dict = {"model": "SmolLM2-135M-Instruct"}
            if not args.push_only:
                smol["throughput"] = [asyncio.run(throughput(server.url, c, max(4, 2 * c), args.max_tokens, args.prompt_tokens))
                                      for c in (1, 8, 32)]  # fmt: skip
            smol["weight_push"] = push_seconds(server.url, Path(args.smollm2), root, args.repeats)
        print(json.dumps(smol), flush=True)


if __name__ == "__main__":
    main()

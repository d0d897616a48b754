"""A vLLM CPU server's start-up, compiled (vLLM's default) against eager (`--enforce-eager`, what
`GRPOFLOW_VLLM_ARGS=--enforce-eager` adds to every server a machine starts), with its one worker inside
the engine-core process (`uni`, what grpoflow starts on a CPU) or in a process of its own (`mp`, vLLM's
CPU default), and what each costs generation afterwards; in float32 (a CPU's server by default) or
bfloat16 (`--dtype`: what a `model.dtype: bfloat16` run's servers serve on a CPU with native bf16,
flows/processes/vllm_command.py: served_dtype).

For each model, mode and executor, one after the other on the same machine: a server started as a run starts its
embedded one (`start_server`), the seconds from the start to /health answering, then generation
tokens/s at concurrency `--concurrency` (default 8 requests of one 32-token prompt, 128 new tokens each,
EOS ignored), the median of `--repeats` rounds after one warm-up round; the server stopped before the
next starts.

    .venv/bin/python benchmarks/server_start.py [--smollm2 models/smollm2-135m] [--dtype float32 bfloat16]
        [--modes eager] [--executors uni] [--concurrency 8] [--no-tiny]

Prints one JSON line per (model, dtype, mode, executor).
"""

from __future__ import annotations

import sys
from pathlib import Path

# This folder has a storage.py; keep it from shadowing the `storage` package when run as a script.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]

import argparse
import asyncio
import json
import os
import statistics
import tempfile
import time

from grpoflow.flows.processes.serve import start_server
from grpoflow.flows.processes.vllm_command import SITE_ARGS_ENV
from grpoflow.tasks.rollouts.inference import VLLMClient

MODES = {"compiled": (), "eager": ("--enforce-eager",)}
# uni: flows/processes/vllm_command.py
EXECUTORS = {"uni": (), "mp": ("--distributed-executor-backend", "mp")}
PROMPT = [3 + (7 * k) % 90 for k in range(32)]


async def _round(url: str, concurrency: int, max_tokens: int) -> tuple[int, float]:
    async with VLLMClient(url) as c:
        t0 = time.perf_counter()
        outs = await asyncio.gather(*(c.complete(PROMPT, max_tokens=max_tokens, seed=i, ignore_eos=True)
                                      for i in range(concurrency)))  # fmt: skip
        return sum(len(ch.token_ids) for out in outs for ch in out), time.perf_counter() - t0


def measure(name: str, model: Path, dtype: str, mode: str, executor: str, args, log_dir: Path) -> dict:
    os.environ.pop(SITE_ARGS_ENV, None)  # the mode alone decides
    t0 = time.perf_counter()
    log = log_dir / f"{name}-{dtype}-{mode}-{executor}.log"
    server = start_server(model, max_model_len=1024, kv_cache_gb=1, log_path=log, startup_timeout_s=900,
                          extra_args=(*MODES[mode], *EXECUTORS[executor]), dtype=dtype)  # fmt: skip
    up = time.perf_counter() - t0
    try:
        asyncio.run(_round(server.url, args.concurrency, 128))  # warm-up
        rates = []
        for _ in range(args.repeats):
            tokens, seconds = asyncio.run(_round(server.url, args.concurrency, 128))
            rates.append(tokens / seconds)
    finally:
        server.stop()
    return {"model": name, "dtype": dtype, "mode": mode, "executor": executor, "startup_s": round(up, 1),
            "concurrency": args.concurrency, "gen_tok_s_median": round(statistics.median(rates), 1),
            "gen_tok_s_rounds": [round(r, 1) for r in rates]}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--smollm2", help="converted SmolLM2-135M model dir")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--dtype", nargs="+", default=["float32"], choices=["float32", "bfloat16"])
    ap.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    ap.add_argument("--executors", nargs="+", default=list(EXECUTORS), choices=list(EXECUTORS))
    ap.add_argument("--no-tiny", action="store_true", help="only the --smollm2 model")
    args = ap.parse_args()
    from grpoflow.tasks.tiny_model import build_tiny_model

    with tempfile.TemporaryDirectory(prefix="grpoflow-server-start-") as tmp:
        models = [] if args.no_tiny else [("tiny", build_tiny_model(Path(tmp) / "tiny"))]
        if args.smollm2:
            models.append(("SmolLM2-135M", Path(args.smollm2).resolve()))
        for name, model in models:
            for mode in args.modes:
                for executor in args.executors:
                    for dtype in args.dtype:
                        row = measure(name, Path(model), dtype, mode, executor, args, Path(tmp))
                        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()

"""Generation throughput on 1 vs N embedded vLLM servers (`inference.replicas`), as a run generates.

For each replica count: start the servers as `grpoflow train` does (each bound to its own share of the
cores), then generate `--batches` steps of `--prompts` prompts x G completions through the run's routing
(tasks/rollouts/replicas.py: each group to the least busy server) and print one JSON line: completion tokens per
second of generation (median over batches after one warm-up batch), and how the groups spread.

    .venv/bin/python benchmarks/replicas.py [--model models/smollm2-135m] [--replicas 1 2] [--batches 4]
"""

from __future__ import annotations

import sys
from pathlib import Path

# This folder has a storage.py; keep it from shadowing the `storage` package when run as a script.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]

import argparse
import json
import os
import statistics
import tempfile
from collections import Counter

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=str(REPO / "models" / "smollm2-135m"))
    ap.add_argument("--replicas", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--batches", type=int, default=4, help="timed batches per count (+1 warm-up)")
    args = ap.parse_args()

    import grpoflow.flows  # noqa: F401  (sets OMP_WAIT_POLICY before torch is imported)
    from grpoflow.examples.envs import arith_rows
    from grpoflow.flows.processes.serve import inference_servers
    from grpoflow.tasks.config.inference import InferenceConfig
    from grpoflow.tasks.config.rollouts import GenerationConfig, ToolsConfig
    from grpoflow.tasks.rollouts.replicas import Replica, ReplicaSet
    from grpoflow.tasks.steps import RolloutJob, rollout_batch

    rows = arith_rows(args.prompts * (args.batches + 1), 0)
    gen = GenerationConfig(group_size=args.group, max_tokens=args.max_tokens, temperature=1.0)
    for n in args.replicas:
        inference = InferenceConfig(replicas=n, max_model_len=512, kv_cache_gb=1)
        with (
            tempfile.TemporaryDirectory() as root,
            inference_servers(inference, args.model, root, "bench") as started,
        ):
            servers = ReplicaSet([Replica(i, s.url) for i, s in enumerate(started)])
            job = RolloutJob(args.model, gen, ToolsConfig(), [], inference, 0, servers)
            rates, spread = [], Counter()
            for b in range(args.batches + 1):
                batch_rows = rows[b * args.prompts : (b + 1) * args.prompts]
                batch = rollout_batch.fn(b, batch_rows, list(range(len(batch_rows))), job)
                m = batch.metrics
                if b:
                    rates.append(m["gen/tokens"] / m["gen_seconds"])
                    spread.update(c.server for g in batch.groups for c in g.completions[:1])
            print(json.dumps({
                "replicas": n, "cores": len(os.sched_getaffinity(0)), "prompts": args.prompts, "group": args.group,
                "max_tokens": args.max_tokens, "tokens_per_s": round(statistics.median(rates), 1),
                "groups_per_server": sorted(spread.values()),
            }), flush=True)  # fmt: skip


if __name__ == "__main__":
    main()

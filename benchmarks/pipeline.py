"""Pipeline benchmark: the same config with max_staleness 0 (synchronous) and 2 (async).

Prints one JSON object per mode: median seconds per step, median generation / scoring / train / sync
seconds, overlap efficiency = step seconds / max(gen + score, train + sync) (1.0 = perfect overlap),
and Prefect's overhead per step. One vLLM server is started and shared by both modes.

    .venv/bin/python benchmarks/pipeline.py [--config configs/tiny-letters.yaml] [--steps 12]
"""

from __future__ import annotations

import sys
from pathlib import Path

# This folder has a storage.py; keep it from shadowing the `storage` package when run as a script.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]

import argparse
import json
import statistics
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # for `benchmarks.workloads`

from benchmarks.workloads import serve


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default=str(REPO / "configs" / "tiny-letters.yaml"))
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--staleness", type=int, nargs="+", default=[0, 2])
    ap.add_argument("--set", action="append", default=[])
    ap.add_argument(
        "--verbose",
        action="store_true",
        help="task runs' INFO lines on the terminal, as `grpoflow train --verbose`",
    )
    args = ap.parse_args()
    from flows.cli import quiet_prefect_task_logs

    quiet_prefect_task_logs(not args.verbose)  # as `grpoflow train` runs it

    from flows.config import load_config
    from flows.runs import prepare_model
    from flows.train import grpo_train
    from storage.sql import query

    root = Path(tempfile.mkdtemp(prefix="grpoflow-bench-"))
    base = load_config(args.config, [f"storage.root={root}", *args.set])
    model = prepare_model(base)
    results = []
    with serve(base, model, root / "vllm.log") as server:
        for k in args.staleness:
            run_id = f"bench-s{k}"
            cfg = load_config(
                args.config,
                [
                    f"storage.root={root}",
                    f"model.path={model}",
                    *args.set,
                    f"inference.url={server.url}",
                    f"run.steps={args.steps}",
                    f"algorithm.max_staleness={k}",
                    f"run.run_id={run_id}",
                    f"run.checkpoint_every={args.steps}",
                ],
            )
            grpo_train(config=cfg)
            cols, rows = query(root, f"SELECT * FROM steps WHERE run_id = '{run_id}' ORDER BY step")
            steps = [dict(zip(cols, r, strict=True)) for r in rows][1:]  # step 0 includes warm-up

            def med(key: str, steps=steps) -> float:
                return statistics.median(float(s.get(key) or 0.0) for s in steps)

            wall = med("wall_seconds")
            gen = med("gen_seconds") + med("score_seconds")
            train = med("train/seconds") + med("sync_seconds")
            results.append(
                {
                    "max_staleness": k,
                    "steps": args.steps,
                    "seconds_per_step": round(wall, 3),
                    "gen_plus_score_seconds": round(gen, 3),
                    "train_plus_sync_seconds": round(train, 3),
                    "overlap_efficiency": round(wall / max(gen, train), 3),
                    "learner_wait_seconds": round(med("wait_seconds"), 3),
                    "prefect_overhead_seconds": round(med("prefect_overhead_seconds"), 4),
                    "prefect_overhead_frac": round(med("prefect_overhead_frac"), 4),
                    "gen_tokens_per_s": round(med("gen/tokens_per_s"), 1),
                    "reward_last": steps[-1].get("reward/mean") if steps else None,
                }
            )
            print(json.dumps(results[-1]), flush=True)
    print(json.dumps({"config": args.config, "results": results}))


if __name__ == "__main__":
    main()

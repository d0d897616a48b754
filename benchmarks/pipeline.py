"""Pipeline benchmark: the same config with max_staleness 0 (synchronous) and 2 (async).

Prints one JSON object per run: median seconds per step, median generation / scoring / train / sync
seconds, overlap efficiency = step seconds / max(gen + score, train + sync) (1.0 = perfect overlap),
and Prefect's overhead per step as the flow's StepRunner counts it. One vLLM server is started and
shared by every run.

`--tasks prefect plain` also runs each config with `run.step_task_runs: false` (the same work as plain
calls, no task run per step; the flow run kept), interleaved `--rounds` times: the difference in s/step
is what the step's task runs cost, the CPU they take from the learner and the server included (the
StepRunner's clock sees only the critical path). Each run also prints the CPU seconds per step of this process
and of the Prefect API server it owns.

    .venv/bin/python benchmarks/pipeline.py [--config configs/tiny-letters.yaml] [--steps 12]
        [--staleness 0 2] [--tasks prefect plain] [--rounds 3]
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


def core_seconds() -> dict[str, float]:
    """CPU seconds so far of this process (flow, learner, rollout client, Prefect's engine) and of the
    Prefect API server it owns (it records the task runs, their states and logs)."""
    import os

    from grpoflow.storage.processes import processes

    out = {"flow_process": 0.0, "prefect_api": 0.0}
    for p in processes():
        if p.pid == os.getpid():
            out["flow_process"] = p.cpu_seconds
        elif p.ppid == os.getpid() and any("prefect.server.api.server:create_app" in a for a in p.argv):
            out["prefect_api"] = p.cpu_seconds
    return out


def summary(k: int, n_steps: int, steps: list[dict]) -> dict:
    """One run's medians over its `steps` rows."""

    def med(key: str) -> float:
        return statistics.median(float(s.get(key) or 0.0) for s in steps)

    wall = med("wall_seconds")
    gen = med("gen_seconds") + med("score_seconds")
    train = med("train/seconds") + med("sync_seconds")
    return {
        "max_staleness": k,
        "steps": n_steps,
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


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default=str(REPO / "configs" / "tiny-letters.yaml"))
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--staleness", type=int, nargs="+", default=[0, 2])
    ap.add_argument("--set", action="append", default=[])
    ap.add_argument("--tasks", nargs="+", choices=["prefect", "plain"], default=["prefect"])
    ap.add_argument("--rounds", type=int, default=1, help="runs of each (staleness, tasks) pair, interleaved")
    ap.add_argument(
        "--verbose",
        action="store_true",
        help="task runs' INFO lines on the terminal, as `grpoflow train --verbose`",
    )
    args = ap.parse_args()
    from grpoflow.flows.cli.shared import quiet_prefect_task_logs

    quiet_prefect_task_logs(not args.verbose)

    from grpoflow.flows.config import load_config
    from grpoflow.flows.training.runs import prepare_model
    from grpoflow.flows.training.train import grpo_train
    from grpoflow.storage.sql import query

    root = Path(tempfile.mkdtemp(prefix="grpoflow-bench-"))
    base = load_config(args.config, [f"storage.root={root}", *args.set])
    model = prepare_model(base)
    results = []
    from grpoflow.flows.processes.prefect_api import owned_prefect_api

    # As `grpoflow train` runs: its own temporary Prefect API server, task runs' INFO lines filtered.
    with owned_prefect_api(), serve(base, model, root / "vllm.log") as server:
        for r in range(args.rounds):
            for k in args.staleness:
                for tasks in args.tasks:
                    run_id = f"bench-s{k}-{tasks}-{r}"
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
                            f"run.step_task_runs={tasks == 'prefect'}",
                        ],
                    )
                    before = core_seconds()
                    grpo_train(config=cfg)
                    used = {k: (v - before[k]) / args.steps for k, v in core_seconds().items()}
                    q = f"SELECT * FROM steps WHERE run_id = '{run_id}' ORDER BY step"
                    cols, rows = query(root, q)
                    steps = [dict(zip(cols, r, strict=True)) for r in rows][1:]  # step 0 includes warm-up
                    results.append({"tasks": tasks, "round": r, **summary(k, args.steps, steps)})
                    results[-1]["core_seconds_per_step"] = {k: round(v, 4) for k, v in used.items()}
                    print(json.dumps(results[-1]), flush=True)
    if len(args.tasks) > 1:
        for k in args.staleness:

            def median(get, tasks: str, k=k) -> float:
                return statistics.median(
                    get(x) for x in results if x["tasks"] == tasks and x["max_staleness"] == k
                )

            step = {t: median(lambda x: x["seconds_per_step"], t) for t in args.tasks}
            cores = {
                part: {
                    t: round(median(lambda x, p=part: x["core_seconds_per_step"][p], t), 4)
                    for t in args.tasks
                }
                for part in ("flow_process", "prefect_api")
            }
            cost = step["prefect"] - step["plain"]
            print(json.dumps({"max_staleness": k, "seconds_per_step": step, "core_seconds_per_step": cores,
                              "prefect_task_runs_cost_seconds": round(cost, 4),
                              "prefect_task_runs_cost_frac": round(cost / step["prefect"], 4)}))  # fmt: skip
    print(json.dumps({"config": args.config, "results": results}))


if __name__ == "__main__":
    main()

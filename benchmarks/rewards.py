"""Reward scoring benchmark: 4 sync + 4 async reward functions that each wait 0.2 s, 64 completions.

Prints JSON: wall seconds of one concurrent `score_groups` call, its ratio to the slowest single
function (target <= 1.2), and the sequential baseline (the same functions one after another).

    .venv/bin/python benchmarks/rewards.py
"""

from __future__ import annotations

import sys
from pathlib import Path

# This folder has a storage.py; keep it from shadowing the `storage` package when run as a script.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]

import json
import time

from grpoflow.storage.records import RolloutCompletion, RolloutGroup
from grpoflow.tasks.config.rewards import RewardConfig
from grpoflow.tasks.rewards.score import score_groups

DELAY = 0.2


def groups() -> list[RolloutGroup]:
    return [
        RolloutGroup(
            f"g{g}",
            g,
            "p",
            [1],
            [RolloutCompletion(i, "abc" * i, [1] * i, [1] * i, [-1.0] * i) for i in range(8)],
        )
        for g in range(8)
    ]


def specs() -> list[RewardConfig]:
    sync = [
        RewardConfig(name=f"sync{i}", fn="grpoflow.examples.rewards:slow_sync", kwargs={"delay": DELAY})
        for i in range(4)
    ]
    asyn = [
        RewardConfig(name=f"async{i}", fn="grpoflow.examples.rewards:slow_async", kwargs={"delay": DELAY})
        for i in range(4)
    ]
    return sync + asyn


def main() -> None:
    score_groups(groups(), specs()[:1])  # warm-up: imports, thread pool
    t0 = time.perf_counter()
    metrics = score_groups(groups(), specs())
    concurrent = time.perf_counter() - t0
    slowest = max(metrics[f"reward/{s.name}/seconds"] for s in specs())
    t0 = time.perf_counter()
    for s in specs():
        score_groups(groups(), [s])
    sequential = time.perf_counter() - t0
    print(
        json.dumps(
            {
                "functions": 8,
                "completions": 64,
                "delay_s": DELAY,
                "concurrent_seconds": round(concurrent, 3),
                "slowest_single_seconds": round(slowest, 3),
                "ratio_to_slowest": round(concurrent / DELAY, 3),
                "sequential_seconds": round(sequential, 3),
                "speedup_vs_sequential": round(sequential / concurrent, 2),
            }
        )
    )


if __name__ == "__main__":
    main()

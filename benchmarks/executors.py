"""Per-call cost of a sync reward's executor: `thread` vs `process` vs `ray` (a local Ray).

Two rewards on 64 completions: a cheap one (grpoflow.examples.rewards:letter_fraction) and a CPU-heavy one
(a pure-Python loop of fixed work, calibrated to about 0.2 s when called directly). Each executor
scores one batch per call through `score_groups`, `--calls` times after a warm-up; prints one JSON
line per (reward, executor): the median wall seconds per call, and the overhead over calling the
function directly in this process.

    .venv/bin/python benchmarks/executors.py [--calls 15]

The heavy reward's module is written to a temporary folder used as the "config folder", so Ray
ships it to its workers (runtime env) and the process pool imports it, as a user's module would be.
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
import time

from grpoflow.flows.cluster import ray_cluster
from grpoflow.storage.records import RolloutCompletion, RolloutGroup
from grpoflow.tasks.config.imports import add_search_dir, import_object
from grpoflow.tasks.config.rewards import RewardConfig
from grpoflow.tasks.config.run import ScaleConfig
from grpoflow.tasks.rewards.score import score_groups

HEAVY = '''
def spin(completions, iterations=1_000_000, **_):
    """Fixed pure-Python work (the GIL held throughout), then a score per completion."""
    acc = 0
    for i in range(iterations):
        acc = (acc + i * i) % 1_000_003
    return [float(acc % 7) for _ in completions]
'''


def groups() -> list[RolloutGroup]:
    return [
        RolloutGroup(
            f"g{g}", g, "p", [1], [RolloutCompletion(i, "abca" * (i + 1), [1], [1], [-1.0]) for i in range(8)]
        )
        for g in range(8)
    ]  # 64 completions


def direct_seconds(fn, kwargs: dict, calls: int) -> float:
    completions = [c.completion for g in groups() for c in g.completions]
    times = []
    for _ in range(calls):
        t0 = time.perf_counter()
        fn(completions=completions, **kwargs)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def calibrate(fn, target_s: float = 0.2) -> int:
    n = 200_000
    t = direct_seconds(fn, {"iterations": n}, 3)
    return int(n * target_s / t)


def per_call(spec: RewardConfig, calls: int) -> float:
    score_groups(groups(), [spec])  # warm-up: imports, pool or workers started
    times = []
    for _ in range(calls):
        t0 = time.perf_counter()
        score_groups(groups(), [spec])
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=15)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="grpoflow-bench-") as folder:
        Path(folder, "bench_heavy.py").write_text(HEAVY)
        add_search_dir(folder)
        heavy = import_object("bench_heavy:spin")
        rewards = {
            "cheap": ("grpoflow.examples.rewards:letter_fraction", {}),
            "heavy": ("bench_heavy:spin", {"iterations": calibrate(heavy)}),
        }
        with ray_cluster(ScaleConfig(ray_address="local"), folder):
            for name, (path, kwargs) in rewards.items():
                direct = direct_seconds(import_object(path), kwargs, args.calls)
                for executor in ("thread", "process", "ray"):
                    spec = RewardConfig(name=name, fn=path, executor=executor, kwargs=kwargs, timeout_s=60)
                    s = per_call(spec, args.calls)
                    row = {"reward": name, "executor": executor, "calls": args.calls}
                    row |= {"median_s": round(s, 4), "direct_s": round(direct, 4)}
                    print(json.dumps(row | {"overhead_s": round(s - direct, 4)}), flush=True)


if __name__ == "__main__":
    main()

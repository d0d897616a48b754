"""Per-call cost of a sync reward's executor: `thread` vs `process` vs `ray` (a local Ray).

Two rewards on 64 completions: a cheap one (grpoflow.examples.rewards:letter_fraction) and a CPU-heavy one
(a pure-Python loop of fixed work, calibrated to about 0.2 s when called directly). Each executor
scores one batch per call through `score_groups`, `--calls` times after a warm-up; prints one JSON
line per (reward, executor): the median wall seconds per call, and the overhead over calling the
function directly in this process.

    .venv/bin/python benchmarks/executors.py [--calls 15]
    .venv/bin/python benchmarks/executors.py --hosts      # root: a local Ray vs a Ray worker on another host

`--hosts` (issue 47) runs the script twice on a learner host (tests/hosts.py: network namespaces on a
bridge): once with a local Ray, once against a Ray head on that host with no CPUs and a worker on a
second host with 2 CPUs, so every `ray` call crosses the bridge; `--ray-address` is how it does that.

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
import os
import statistics
import subprocess
import tempfile
import time

from grpoflow.flows.processes.cluster import ray_cluster
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


def on_hosts(calls: int) -> None:
    """This script on a learner host: with a local Ray, then with the Ray worker on another host."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from tests.hosts import Hosts, ray_node

    port = 6379
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0"}
    me = [sys.executable, str(Path(__file__).resolve()), "--calls", str(calls)]
    with Hosts(2, prefix="ge") as (learner, worker), tempfile.TemporaryDirectory(dir="/tmp") as temp:

        def start(host, *args):
            log = open(Path(temp) / f"{host.name}.log", "ab")  # noqa: SIM115 (the process keeps its own)
            return host.run(
                ray_node(host, f"{temp}/{host.name}", *args), env=env, stdout=log, stderr=subprocess.STDOUT
            )

        for where, address in (("local", "local"), ("remote", f"{learner.address}:{port}")):
            if where == "remote":
                start(learner, "--head", f"--port={port}", "--num-cpus=0")
                learner.wait_port(port, 120)
                start(worker, f"--address={learner.address}:{port}", "--num-cpus=2")
                time.sleep(10)  # the worker's node joins
            out = learner.check_output([*me, "--ray-address", address, "--executors", "ray", "--label", where],
                                       env=env, timeout_s=1800)  # fmt: skip
            print(out, end="", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=15)
    ap.add_argument("--hosts", action="store_true", help="a local Ray vs a Ray worker on another host (root)")
    ap.add_argument("--ray-address", default="local")
    ap.add_argument("--executors", default="thread,process,ray")
    ap.add_argument("--label", default=None, help="a `ray` field of every line (where the Ray calls ran)")
    args = ap.parse_args()
    if args.hosts:
        return on_hosts(args.calls)
    with tempfile.TemporaryDirectory(prefix="grpoflow-bench-") as folder:
        Path(folder, "bench_heavy.py").write_text(HEAVY)
        add_search_dir(folder)
        heavy = import_object("bench_heavy:spin")
        rewards = {
            "cheap": ("grpoflow.examples.rewards:letter_fraction", {}),
            "heavy": ("bench_heavy:spin", {"iterations": calibrate(heavy)}),
        }
        with ray_cluster(ScaleConfig(ray_address=args.ray_address), folder):
            for name, (path, kwargs) in rewards.items():
                direct = direct_seconds(import_object(path), kwargs, args.calls)
                for executor in args.executors.split(","):
                    spec = RewardConfig(name=name, fn=path, executor=executor, kwargs=kwargs, timeout_s=60)
                    s = per_call(spec, args.calls)
                    row = {"reward": name, "executor": executor, "calls": args.calls}
                    row |= {"ray": args.label} if args.label else {}
                    row |= {"median_s": round(s, 4), "direct_s": round(direct, 4)}
                    print(json.dumps(row | {"overhead_s": round(s - direct, 4)}), flush=True)


if __name__ == "__main__":
    main()

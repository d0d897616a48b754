"""Fault matrix: inject each fault into a real run, and count what it cost.

One vLLM CPU server (tiny model) and one temporary Prefect API are shared by every drill:

- SIGKILL of the training process at many seeded random failpoints (tests/drill.py KILL_POINTS: every
  phase once per 10 kills, each at a random hit), a resume after each: rows lost, duplicates, temp
  files left, and processes of the run that survived it (orphans);
- SIGKILL of the training process at each named point (tests/drill.py KILL_DRILL), then
  `grpoflow train --resume`;
- SIGKILL of the run's own embedded vLLM server mid-run (the flow restarts it);
- ~30% failing reward cells in mixed ways, a reward that hangs or raises, and a tool that hangs or raises
  (configs/tiny-faults.yaml, with the tiny model taught to call the tool).

Per drill it prints one JSON object: faults injected, whether the run completed, rows lost (expected
completions minus stored ones), duplicate rows, and wall seconds. Then a table.

    .venv/bin/python benchmarks/faults.py [--skip-server-kill] [--random-kills 20 --seed 0] [--only-random]
"""

from __future__ import annotations

import sys
from pathlib import Path

# This folder has a storage.py; keep it from shadowing the `storage` package when run as a script.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # grpoflow's packages, `tests.drill`

import argparse
import json
import os
import shutil
import signal
import subprocess
import tempfile
import threading
import time

REPO = Path(__file__).resolve().parents[1]
PER_STEP, GROUP = 8, 8  # prompts per step and group size of configs/tiny-letters.yaml / tiny-faults.yaml


def store_counts(root: Path, run_id: str, steps: int) -> dict:
    from grpoflow.storage.sql import query

    _, rows = query(
        root,
        f"SELECT count(*), count(DISTINCT (step, group_id, sample_index)) FROM rollouts WHERE run_id = '{run_id}'",
    )
    n, distinct = rows[0]
    _, srows = query(root, f"SELECT count(*), count(DISTINCT step) FROM steps WHERE run_id = '{run_id}'")
    return {
        "rows_lost": steps * PER_STEP * GROUP - distinct,
        "duplicate_rows": n - distinct + (srows[0][0] - srows[0][1]),
        "steps_stored": srows[0][1],
    }


def kill_drill(root: Path, model: Path, url: str, env: dict) -> list[dict]:
    from tests.drill import KILL_DRILL, KILL_DRILL_SETS

    out = []
    for point, spec in KILL_DRILL.items():
        run_id = f"kill-{point.replace('_', '-')}"
        sets = [f"storage.root={root}", f"model.path={model}", f"inference.url={url}", *KILL_DRILL_SETS]
        args = [a for s in sets for a in ("--set", s)]
        base = [sys.executable, "-m", "grpoflow.flows.cli.main", "train"]
        t0 = time.perf_counter()
        first = subprocess.run([*base, "--run-id", run_id, *args], cwd=REPO, capture_output=True,
                               env={**env, "GRPOFLOW_FAULTS": spec}, timeout=900)  # fmt: skip
        again = subprocess.run([*base, "--resume", run_id, *args], cwd=REPO, capture_output=True, env=env,
                               timeout=900)  # fmt: skip
        out.append(
            {
                "fault": f"SIGKILL at {point}",
                "faults_injected": int(first.returncode == -signal.SIGKILL),
                "completed": again.returncode == 0,
                **store_counts(root, run_id, 6),
                "seconds": round(time.perf_counter() - t0, 1),
            }
        )
        print(json.dumps(out[-1]), flush=True)
    return out


def server_kill_drill(root: Path, model: Path) -> dict:
    """The run's own embedded server is SIGKILLed after step 3 is stored."""
    from grpoflow.flows.config import load_config
    from grpoflow.flows.training.train import grpo_train
    from grpoflow.storage.rollouts import RolloutStore

    own = root / "embedded-model"  # a unique path, so pgrep finds only this run's server
    shutil.copytree(model, own)
    steps, run_id = 8, "kill-server"
    cfg = load_config(REPO / "configs" / "tiny-letters.yaml", [
        f"storage.root={root}", f"model.path={own}", f"run.steps={steps}", f"run.run_id={run_id}",
        "algorithm.max_staleness=1", "inference.retries=2",
    ])  # fmt: skip
    store, killed = RolloutStore(root), []

    def killer():
        deadline = time.time() + 900
        while time.time() < deadline and len(store.steps_written("steps", run_id)) < 3:
            time.sleep(0.2)
        pids = subprocess.run(["pgrep", "-f", f"api_server --model {own}"], capture_output=True, text=True)
        for pid in pids.stdout.split():
            os.killpg(int(pid), signal.SIGKILL)
            killed.append(pid)

    t0 = time.perf_counter()
    t = threading.Thread(target=killer)
    t.start()
    try:
        completed = grpo_train(config=cfg)["steps_trained"] == steps
    except Exception as e:
        print(f"server-kill run failed: {e!r}", file=sys.stderr)
        completed = False
    t.join()
    out = {
        "fault": "SIGKILL of the vLLM server",
        "faults_injected": len(killed),
        "completed": completed,
        **store_counts(root, run_id, steps),
        "seconds": round(time.perf_counter() - t0, 1),
    }
    print(json.dumps(out), flush=True)
    return out


def reward_tool_drill(root: Path, model: Path, url: str) -> dict:
    from grpoflow.flows.config import load_config
    from grpoflow.flows.training.train import grpo_train
    from grpoflow.storage.sql import query

    steps, run_id = 8, "reward-tool-faults"
    cfg = load_config(REPO / "configs" / "tiny-faults.yaml", [
        f"storage.root={root}", f"model.path={model}", f"inference.url={url}", f"run.steps={steps}",
        f"run.run_id={run_id}",
    ])  # fmt: skip
    t0 = time.perf_counter()
    completed = grpo_train(config=cfg)["steps_trained"] == steps
    seconds = time.perf_counter() - t0
    _, r = query(root, f"SELECT count(*) FILTER (WHERE status <> 'valid'), count(*) FILTER (WHERE reward_name = "
                       f"'letters' AND status <> 'valid') FROM rewards WHERE run_id = '{run_id}'")  # fmt: skip
    _, t = query(root, f"SELECT count(*), count(*) FILTER (WHERE failed), count(*) FILTER (WHERE error LIKE "
                       f"'%timed out%') FROM tool_calls WHERE run_id = '{run_id}'")  # fmt: skip
    _, s = query(root, f"SELECT max(wall_seconds), median(wall_seconds) FROM steps WHERE run_id = '{run_id}'")
    cells = steps * PER_STEP * GROUP
    out = {
        "fault": "failing rewards + hanging tool",
        "faults_injected": r[0][0] + t[0][1],
        "reward_cells_bad": r[0][0],
        "letters_bad_frac": round(r[0][1] / cells, 3),
        "tool_calls": t[0][0],
        "tool_failures": t[0][1],
        "tool_timeouts": t[0][2],
        "slowest_step_s": round(s[0][0], 2),
        "median_step_s": round(s[0][1], 2),
        "completed": completed,
        **store_counts(root, run_id, steps),
        "seconds": round(seconds, 1),
    }
    print(json.dumps(out), flush=True)
    return out


def random_drill(root: Path, model: Path, url: str, env: dict, kills: int, seed: int) -> dict:
    """SIGKILL the run process at `kills` seeded random failpoints, resuming after each; then check every
    table, temp files, the run's status, and that no process the run started survived a kill."""
    from tests.drill import random_kill_drill, store_check

    # Each kill costs at most 2 steps (tests/drill.py KILL_POINTS), so every planned kill fires while
    # kills < steps / 2.
    steps, run_id = max(120, 2 * kills + 4), "random-kills"
    sets = [f"model.path={model}", f"inference.url={url}", f"run.steps={steps}", "run.checkpoint_every=2",
            "algorithm.max_staleness=1", "storage.compact_every=2"]  # fmt: skip
    store = root / "random"
    fig = random_kill_drill(store, run_id, sets, kills=kills, seed=seed, env=env)
    check = store_check(store, run_id, steps, PER_STEP * GROUP)
    dupes = sum(v for k, v in check.items() if k.endswith("_duplicates"))
    result = {
        "fault": f"SIGKILL at {fig['kills']} random failpoints",
        "faults_injected": fig["kills"],
        "completed": fig["completed"] and check["status"] == "completed",
        "rows_lost": check["rows_lost"],
        "duplicate_rows": dupes,
        "orphans": fig["orphans"],
        "temp_files_left": len(check["temp_files"]),
        "superseded_files_left": len(check["superseded_files"]),
        "steps_rows": check["steps_rows"],
        "statuses_after_kill": sorted(set(fig["statuses_after_kill"])),
        "kill_points": fig["planned"],
        "fired": [f for fired in fig["fired"] for f in fired],  # what the store's kill records say
        "seconds": fig["seconds"],
    }
    print(json.dumps(result))
    return result


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--skip-server-kill", action="store_true", help="skip the drill that restarts a server")
    ap.add_argument("--random-kills", type=int, default=20, help="SIGKILLs at random failpoints (0: skip)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the random kill points")
    ap.add_argument("--only-random", action="store_true", help="run only the random-failpoint drill")
    args = ap.parse_args()

    from prefect.settings import PREFECT_API_URL
    from prefect.testing.utilities import prefect_test_harness

    from grpoflow.flows.processes.serve import embedded_server
    from grpoflow.tasks.tiny_model import build_tiny_model

    root = Path(tempfile.mkdtemp(prefix="grpoflow-faults-"))
    model = build_tiny_model(root / "tiny")
    results = []
    with (
        prefect_test_harness(server_startup_timeout=120),
        embedded_server(str(model), max_model_len=1024, kv_cache_gb=1, log_path=root / "vllm.log") as server,
    ):
        env = dict(os.environ, PREFECT_API_URL=str(PREFECT_API_URL.value()))
        if args.random_kills:
            results.append(random_drill(root, model, server.url, env, args.random_kills, args.seed))
        if not args.only_random:
            results += kill_drill(root, model, server.url, env)
            results.append(reward_tool_drill(root, model, server.url))
            if not args.skip_server_kill:
                results.append(server_kill_drill(root, model))
    print(f"\n{'fault':36} {'injected':>8} {'completed':>9} {'rows lost':>9} {'dupes':>5} {'seconds':>7}")
    for r in results:
        print(f"{r['fault']:36} {r['faults_injected']:>8} {r['completed']!s:>9} {r['rows_lost']:>9} "
              f"{r['duplicate_rows']:>5} {r['seconds']:>7}")  # fmt: skip
    runs = sum(r["completed"] for r in results)
    print(f"\n{len(results)} drills, {runs} runs completed, {sum(r['rows_lost'] for r in results)} rows lost")
    shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()

"""Kill drills. The named-point drill (KILL_DRILL): one SIGKILL per failpoint of a step. The random-moment
drill: SIGKILL `grpoflow train` at seeded random moments, resume after each, then check the store and
the process table. Both are run by the slow tests (a few kills) and by benchmarks/faults.py (many):
a harness of the checkout's, beside the tests, not a part of the installed package.

Only the run's own process is killed, as the kernel's OOM killer does: no cleanup code runs.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

from grpoflow.storage.faults import ENV as FAULTS_ENV
from grpoflow.storage.processes import guarded_children, kill_tree

REPO = Path(__file__).resolve().parents[1]

# The named-point drill: one kill per failpoint (storage/faults.py) of a step, for
# configs/tiny-letters.yaml with KILL_DRILL_SETS against an external server (its initial weight push
# is push 1).
KILL_DRILL = {
    "generation": "generate@28:kill",  # the 4th group of step 3, generated while step 2 trains
    "scoring": "score@3:kill",  # step 2's rewards computed, not yet applied
    "parquet_write": "parquet_write@8:kill",  # step 2's rewards file fsynced, not yet renamed
    "weight_push": "weight_push@3:kill",  # step 1's weights saved, server paused, no reload yet
    "checkpoint_write": "checkpoint_write@2:kill",  # step 3's checkpoint written, not yet published
    "after_checkpoint": "checkpoint_done@2:kill",  # step 3's checkpoint published: its steps row must be too
}
KILL_DRILL_SETS = ("run.steps=6", "run.checkpoint_every=2", "algorithm.max_staleness=1")


def store_check(root: Path, run_id: str, steps: int, per_step: int) -> dict:
    """Rows lost and duplicated in each table (as SQL reads them: compacted ranges hide the files they
    replaced), temp files left, files a compacted range superseded but nothing deleted, and the run's
    recorded status."""
    from grpoflow.storage.layout import list_parts, select
    from grpoflow.storage.sql import query, run_status

    out: dict = {}
    for table, key in (
        ("rollouts", "group_id, sample_index"),
        ("rewards", "group_id, sample_index, reward_name"),
    ):
        _, rows = query(
            root, f"SELECT count(*), count(DISTINCT (step, {key})), count(DISTINCT step) FROM {table} WHERE run_id = $run",
            {"run": run_id},
        )  # fmt: skip
        n, distinct, nsteps = rows[0]
        out[f"{table}_duplicates"] = n - distinct
        out[f"{table}_steps"] = nsteps
    _, rows = query(
        root, "SELECT count(*), count(DISTINCT step) FROM steps WHERE run_id = $run", {"run": run_id}
    )
    out["steps_duplicates"] = rows[0][0] - rows[0][1]
    out["steps_rows"] = rows[0][1]
    _, rows = query(
        root,
        "SELECT count(DISTINCT (step, group_id, sample_index)) FROM rollouts WHERE run_id = $run",
        {"run": run_id},
    )
    out["rows_lost"] = steps * per_step - rows[0][0]
    out["temp_files"] = sorted(
        str(p.relative_to(root)) for p in root.rglob(".*") if ".tmp" in p.name or ".old-" in p.name
    )
    out["superseded_files"] = sorted(
        p.path.name
        for t in ("rollouts", "rewards", "steps")
        for p in select(list_parts(root / t / f"run_id={run_id}"))[1]
    )
    meta = json.loads((root / "runs" / f"{run_id}.json").read_text())
    out["status"] = run_status(meta)
    return out


def clean_store(steps: int) -> dict:
    """What `store_check` reports for a run of `steps` steps that lost and duplicated nothing."""
    tables = {
        f"{t}_{k}": v for t in ("rollouts", "rewards") for k, v in (("duplicates", 0), ("steps", steps))
    }
    return tables | {"steps_duplicates": 0, "steps_rows": steps, "rows_lost": 0, "temp_files": [],
                     "superseded_files": [], "status": "completed"}  # fmt: skip


def _left_behind(pid: int, within_s: float) -> list[int]:
    """What `pid` started under the guard and is still alive once its guards have had `within_s` seconds
    to take their groups down (they notice a dead parent within 0.5 s)."""
    deadline = time.monotonic() + within_s
    while (left := guarded_children(pid)) and time.monotonic() < deadline:
        time.sleep(0.2)
    return left


def random_kill_drill(
    root: Path,
    run_id: str,
    sets: list[str],
    *,
    kills: int,
    seed: int,
    window_s: tuple[float, float],
    env: dict | None = None,
    timeout_s: float = 600,
    config: str | None = None,
    step_sleep_s: float | None = None,
) -> dict:
    """`kills` SIGKILLs of `grpoflow train` (then `--resume RUN`) at moments drawn uniformly from
    `window_s` seconds after each launch, then one last resume that must finish. Returns the figures.

    `step_sleep_s`: every train step sleeps this long first (the `train:sleep` failpoint, a slow
    learner), so that a run of N steps lasts at least N x that on any host, and a kill drawn before
    then lands in it rather than after a run that has already ended."""
    rng = random.Random(seed)
    set_args = [a for s in [f"storage.root={root}", *sets] for a in ("--set", s)]
    set_args = ["--config", str(config), *set_args] if config else set_args
    env = {**os.environ, **(env or {})}
    if step_sleep_s is not None:
        env[FAULTS_ENV] = ",".join(filter(None, [env.get(FAULTS_ENV), f"train:sleep={step_sleep_s}"]))
    first = [sys.executable, "-m", "grpoflow.flows.cli.main", "train", "--run-id", run_id, *set_args]
    again = [sys.executable, "-m", "grpoflow.flows.cli.main", "train", "--resume", run_id, *set_args]
    figures = {"kills": 0, "orphans": 0, "finished_early": 0, "kill_moments_s": [], "statuses_after_kill": []}
    t0 = time.perf_counter()
    started = False
    for _ in range(kills):
        cmd = again if started and (root / "runs" / f"{run_id}.json").is_file() else first
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        started = True
        moment = rng.uniform(*window_s)
        try:
            proc.wait(moment)
            figures["finished_early"] += 1  # the run completed before its kill moment
            break
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGKILL)
            proc.wait()
        figures["kills"] += 1
        figures["kill_moments_s"].append(round(moment, 2))
        left = _left_behind(proc.pid, within_s=3.0)
        figures["orphans"] += len(left)
        kill_tree(left)
        meta = root / "runs" / f"{run_id}.json"
        if meta.is_file():
            from grpoflow.storage.sql import run_status

            figures["statuses_after_kill"].append(run_status(json.loads(meta.read_text())))
    cmd = again if (root / "runs" / f"{run_id}.json").is_file() else first
    final = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout_s)
    figures["completed"] = final.returncode == 0
    figures["final_output"] = (final.stdout + final.stderr)[-3000:] if final.returncode else ""
    figures["seconds"] = round(time.perf_counter() - t0, 1)
    return figures

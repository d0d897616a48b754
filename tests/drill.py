"""Kill drills. The named-point drill (KILL_DRILL): one SIGKILL per failpoint of a step. The random
drill: SIGKILL `grpoflow train` at seeded random (failpoint, hit) pairs, resume after each, then check
the store and the process table. Both are run by the slow tests (a few kills) and by
benchmarks/faults.py (many): a harness of the checkout's, beside the tests, not a part of the
installed package.

Kills fire at failpoints (storage/faults.py), never at a moment of the wall clock: a moment lands in a
different phase, or after the run has ended, on a faster or slower host; a failpoint's hit is the same
phase of the same step on any host. Which kill fired where is read back from the store (the record
the failpoint publishes just before it kills), not assumed.

Only the run's own process is killed, as the kernel's OOM killer does: no cleanup code runs.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from grpoflow.storage.faults import ENV as FAULTS_ENV
from grpoflow.storage.faults import RECORD_ENV
from grpoflow.storage.processes import guarded_children, kill_tree

REPO = Path(__file__).resolve().parents[1]

# The named-point drill: one kill per failpoint (storage/faults.py) of a step, for
# configs/tiny-letters.yaml with KILL_DRILL_SETS against an external server (its initial weight push
# is push 1). Hits count from a launch's start, fresh or resumed: each kill lands within the launch's
# first 4 steps. benchmarks/faults.py kills a fresh run at each; test_train_flow.py kills one run at each
# in turn, resuming after each.
KILL_DRILL = {
    "generation": "generate@28:kill",  # the 4th group of step 3, generated while step 2 trains
    "scoring": "score@3:kill",  # step 2's rewards computed, not yet applied
    "parquet_write": "parquet_write@8:kill",  # step 2's rewards file fsynced, not yet renamed
    "weight_push": "weight_push@3:kill",  # step 1's weights saved, server paused, no reload yet
    "checkpoint_write": "checkpoint_write@2:kill",  # step 3's checkpoint written, not yet published
    "after_checkpoint": "checkpoint_done@2:kill",  # step 3's checkpoint published: its steps row must be too
}
KILL_DRILL_SETS = ("run.steps=6", "run.checkpoint_every=2", "algorithm.max_staleness=1")

# The random drill's points, each with the highest hit it draws. Every pair is reached within the first
# two steps of any launch, fresh or resumed (>= 6 groups a step, 3 Parquet files a step, a checkpoint
# every 2 steps, an external server's first push), so a kill costs the run at most 2 steps: k kills need
# a run of more than 2k steps, and each kill then fires. `compact_*` only with storage.compact_every=2
# (a compaction after every checkpoint); STEP_POINTS leaves them out, for runs that compact at the end.
KILL_POINTS = {
    "run_start": 1,  # the record says `running`, nothing started yet
    "generate": 12,  # a group of step 0 or 1 generated, the others in flight
    "score": 2,  # step 0's or 1's rewards computed, not applied
    "parquet_write": 5,  # a rollouts/rewards/steps file of step 0 or 1 fsynced, not renamed
    "train": 2,  # step 0's or 1's update about to run
    "weight_push": 2,  # the first push, or step 0's: server paused, no reload yet
    "checkpoint_write": 1,  # the launch's first checkpoint written, not published
    "checkpoint_done": 1,  # ... published
    "compact_write": 1,  # the compaction after it: a range fsynced, not renamed
    "compact_publish": 1,  # ... renamed, its sources not yet deleted
}
STEP_POINTS = {p: hit for p, hit in KILL_POINTS.items() if not p.startswith("compact_")}


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


def kill_plan(kills: int, seed: int, points: dict[str, int]) -> list[str]:
    """`kills` seeded `point@hit` specs: the points in a shuffled order, every one once before any
    repeats (so len(points) kills cover every phase), each at a hit drawn from 1..its highest."""
    rng = random.Random(seed)
    order: list[str] = []
    while len(order) < kills:
        order += rng.sample(sorted(points), len(points))
    return [f"{p}@{rng.randint(1, points[p])}" for p in order[:kills]]


def _fired(record_dir: Path, pid: int) -> list[str]:
    """The `point@hit` of each kill the failpoints recorded for process `pid`."""
    found = [json.loads(f.read_text()) for f in sorted(record_dir.glob(f"kill-{pid}-*.json"))]
    return [f"{r['point']}@{r['hit']}" for r in found]


def _steps_rows(root: Path, run_id: str) -> int:
    from grpoflow.storage.sql import query

    if not (root / "steps").is_dir():
        return 0
    _, rows = query(root, "SELECT count(DISTINCT step) FROM steps WHERE run_id = $run", {"run": run_id})
    return rows[0][0]


def _launch(cmd: list[str], env: dict, timeout_s: float) -> tuple[subprocess.Popen, str]:
    """Run `cmd` to its end (or kill it after `timeout_s`: then no failpoint record names it); the
    process and the tail of its stderr."""
    # stderr to a file, not a pipe: a server the run started keeps its copy open until its guard takes
    # it down, and reading a pipe to its end would wait for that
    with tempfile.TemporaryFile() as err:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=err)
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        err.seek(0)
        return proc, err.read().decode(errors="replace")[-3000:]


def random_kill_drill(
    root: Path,
    run_id: str,
    sets: list[str],
    *,
    kills: int,
    seed: int,
    points: dict[str, int] | None = None,
    env: dict | None = None,
    timeout_s: float = 600,
    config: str | None = None,
) -> dict:
    """`kills` launches of `grpoflow train` (then `--resume RUN`), each SIGKILLed by its failpoint at a
    seeded (point, hit) of `points` (default KILL_POINTS), then one last resume that must finish.

    Returns the figures: `planned` (the `point@hit` of each launch), `fired` (what the failpoints recorded
    in `<root>/faults/<run_id>` before killing, per launch: [] when it was not reached), `exit_codes`,
    `finished_early` (launches that ended without their kill), `steps_rows_after_kill` and
    `statuses_after_kill` (what each killed attempt left), `orphans`, `completed`; `launch_output`, the
    stderr of a launch that was not killed."""
    from grpoflow.storage.sql import run_status

    set_args = [a for s in [f"storage.root={root}", *sets] for a in ("--set", s)]
    set_args = ["--config", str(config), *set_args] if config else set_args
    env = {**os.environ, **(env or {})}
    record_dir = root / "faults" / run_id
    env[RECORD_ENV] = str(record_dir)
    first = [sys.executable, "-m", "grpoflow.flows.cli.main", "train", "--run-id", run_id, *set_args]
    again = [sys.executable, "-m", "grpoflow.flows.cli.main", "train", "--resume", run_id, *set_args]
    meta = root / "runs" / f"{run_id}.json"
    figures: dict = {"planned": kill_plan(kills, seed, points or KILL_POINTS), "fired": [], "exit_codes": [],
                     "kills": 0, "finished_early": 0, "orphans": 0, "steps_rows_after_kill": [],
                     "statuses_after_kill": []}  # fmt: skip
    t0 = time.perf_counter()
    for spec in figures["planned"]:
        launch_env = {**env, FAULTS_ENV: ",".join(filter(None, [env.get(FAULTS_ENV), f"{spec}:kill"]))}
        proc, output = _launch(again if meta.is_file() else first, launch_env, timeout_s)
        figures["exit_codes"].append(proc.returncode)
        figures["fired"].append(_fired(record_dir, proc.pid))
        if proc.returncode != -signal.SIGKILL:  # finished (its point never reached) or failed
            figures["finished_early"] += proc.returncode == 0
            figures["launch_output"] = output
            break
        figures["kills"] += 1
        left = _left_behind(proc.pid, within_s=3.0)
        figures["orphans"] += len(left)
        kill_tree(left)
        figures["steps_rows_after_kill"].append(_steps_rows(root, run_id))
        if meta.is_file():
            figures["statuses_after_kill"].append(run_status(json.loads(meta.read_text())))
    cmd = again if meta.is_file() else first
    final = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout_s)
    figures["completed"] = final.returncode == 0
    figures["final_output"] = (final.stdout + final.stderr)[-3000:] if final.returncode else ""
    figures["seconds"] = round(time.perf_counter() - t0, 1)
    return figures

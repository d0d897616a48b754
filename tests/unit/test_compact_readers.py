"""The acceptance test of compaction: SQL readers during compactions and SIGKILLs always count every
step's rows exactly once.

A writer process writes steps (real RolloutStore files, synthetic groups) and compacts the steps it
has written after every second step, as a run compacts its closed steps; it is SIGKILLed again and
again, at the compaction's failpoints and at seeded hits of the step files' own (`parquet_write`: a
step's file written, not yet renamed), never at a wall-clock moment, and restarted where its progress
file says it stopped (first deleting later steps' files, as a resume does). Meanwhile a reader
thread in this process runs storage.sql.query in a loop. Every answer must hold each step it shows
exactly rows-per-step times, and every step the writer had finished before the query began. No vLLM
server, no Prefect.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from grpoflow.storage.compact import compact_run
from grpoflow.storage.layout import list_parts, select
from grpoflow.storage.rollouts import RolloutStore
from grpoflow.storage.sql import query
from tests.support import wait_for

pytestmark = pytest.mark.unit
REPO = Path(__file__).resolve().parents[2]
STEPS, PER_STEP, EVERY = 100, 8, 2  # 2-step ranges, then 20-step ones: both tiers under fire
QUOTA = 8  # steps one launch writes at most (4 compactions), so each failpoint is reached

WRITER = """
import sys
from pathlib import Path
from grpoflow.storage.compact import compact_run
from grpoflow.storage.records import RewardCell, RolloutCompletion, RolloutGroup
from grpoflow.storage.rollouts import RolloutStore, atomic_write_text


def group(step, n):
    comps = [RolloutCompletion(i, "c", [step, i], [1, 1], [-0.5, -1.0], reward=1.0, reward_valid=True,
                               reward_cells=[RewardCell("acc", 1.0, "valid")]) for i in range(n)]
    return RolloutGroup(f"train-{step:08d}", step, "p", [1, 2], comps)


root, steps, per_step, every, quota = Path(sys.argv[1]), *map(int, sys.argv[2:6])
store, progress = RolloutStore(root), Path(sys.argv[1]) / "progress"
done = int(progress.read_text()) if progress.exists() else -1
store.delete_steps_after("w", done)  # as a resume does: later steps' files and temp files go
for s in range(done + 1, min(steps, done + 1 + quota)):
    g = group(s, per_step)
    store.write_rollouts("w", s, [g])
    store.write_rewards("w", s, [g])
    atomic_write_text(progress, str(s))
    if s % 2 == 1:  # the steps written so far are never rewritten: closed
        compact_run(root, "w", s, every, final=s == steps - 1)
"""


def _finished(root: Path) -> int:
    p = root / "progress"
    return int(p.read_text()) if p.exists() else -1


def _reader(root: Path, stop: threading.Event, answers: list, errors: list) -> None:
    store = RolloutStore(root)
    while not stop.is_set():
        finished = _finished(root)  # read before the query: all of these must be in its answer
        try:
            for table in ("rollouts", "rewards"):
                counts = dict(query(root, f"SELECT step, count(*) FROM {table} GROUP BY step")[1])
                wrong = {s: n for s, n in counts.items() if n != PER_STEP}
                missing = [s for s in range(finished + 1) if s not in counts]
                if wrong or missing:
                    errors.append((table, finished, wrong, missing))
                answers.append(len(counts))
            if not set(range(finished + 1)) <= set(store.steps_written("rollouts", "w")):
                errors.append(("steps_written", finished))
        except Exception as e:  # a vanished file, a partial file: the guarantee is broken
            errors.append(repr(e))
        time.sleep(0.005)  # leave the writer some CPU on a small machine


def test_sql_during_compactions_and_kills_counts_every_step_exactly_once(tmp_path):
    rng = random.Random(7)
    # Kills at the compaction's two moments, and between them at seeded step-file writes: a launch writes
    # 2 files a step for at least QUOTA steps (more than 20 steps are always left), so each hit is reached.
    compaction = [
        "compact_publish@1",
        "compact_write@2",
        "compact_publish@3",
        "compact_write@1",
        "compact_publish@2",
    ]
    plan = [p for c in compaction for p in (c, f"parquet_write@{rng.randint(1, 2 * QUOTA)}")]
    stop, answers, errors = threading.Event(), [], []
    reader = threading.Thread(target=_reader, args=(tmp_path, stop, answers, errors))
    reader.start()
    cmd = [sys.executable, "-c", WRITER, str(tmp_path), str(STEPS), str(PER_STEP), str(EVERY)]
    killed = []
    try:
        for point in plan:
            env = {**os.environ, "GRPOFLOW_FAULTS": f"{point}:kill"}
            proc = subprocess.run([*cmd, str(QUOTA)], cwd=REPO, env=env, stderr=subprocess.PIPE, timeout=120)
            err = proc.stderr.decode()
            assert proc.returncode in (0, -signal.SIGKILL), err[-3000:]
            if proc.returncode == -signal.SIGKILL:
                killed.append(point)
        final = subprocess.run([*cmd, str(STEPS)], cwd=REPO, capture_output=True, text=True, timeout=120)
        assert final.returncode == 0, final.stderr[-3000:]
        n = len(answers)  # two whole rounds (2 tables each) on the finished store too
        wait_for(lambda: len(answers) >= n + 4, 30, "the reader's answers on the finished store")
    finally:
        stop.set()
        reader.join()
    assert errors == []
    assert killed == plan and len(answers) > 20, (killed, len(answers))  # every kill fired where planned
    assert _finished(tmp_path) == STEPS - 1

    compact_run(tmp_path, "w", STEPS - 1, EVERY, final=True)  # the next compaction cleans up
    for table in ("rollouts", "rewards"):
        d = tmp_path / table / "run_id=w"
        visible, covered = select(list_parts(d))
        assert covered == [] and not list(d.glob(".*.tmp"))
        assert [p.path.name for p in visible] == [
            f"range-{lo:06d}-{lo + 19:06d}.parquet" for lo in range(0, STEPS, 20)
        ]
        counts = dict(query(tmp_path, f"SELECT step, count(*) FROM {table} GROUP BY step")[1])
        assert counts == dict.fromkeys(range(STEPS), PER_STEP)

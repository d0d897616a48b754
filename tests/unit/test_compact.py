"""Compaction (storage/compact.py) and what readers see (storage/layout.py): real Parquet files read by
pyarrow and DuckDB, kills by failpoint in a subprocess."""

from __future__ import annotations

import logging
import os
import random
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from grpoflow.storage import compact as compact_mod
from grpoflow.storage.checkpoints import CheckpointStore
from grpoflow.storage.compact import BackgroundCompactor, closed_through, compact_run, compact_store, plan
from grpoflow.storage.layout import Part, StoreLayoutError, list_parts, reading, run_lock, select
from grpoflow.storage.processes import identity
from grpoflow.storage.records import RewardCell, RolloutCompletion, RolloutGroup
from grpoflow.storage.rollouts import RolloutStore
from grpoflow.storage.sql import query

pytestmark = pytest.mark.unit
REPO = Path(__file__).resolve().parents[2]
PER_STEP = 4


def group(step: int, n: int = PER_STEP) -> RolloutGroup:
    comps = [
        RolloutCompletion(i, f"s{step} c{i}", [step, i], [1, 1], [-0.5, -1.0], reward=float(i),
                          reward_valid=True, reward_cells=[RewardCell("acc", float(i), "valid")])
        for i in range(n)
    ]  # fmt: skip
    return RolloutGroup(f"train-{step:08d}", step, "p", [1, 2], comps)


def write_steps(store: RolloutStore, run: str, steps, *, metric_on=lambda s: {}) -> None:
    for s in steps:
        g = group(s)
        store.write_rollouts(run, s, [g])
        store.write_rewards(run, s, [g])
        store.write_step(run, s, {"loss": float(s), **metric_on(s)})


def names(root: Path, run: str, table: str = "rollouts") -> list[str]:
    return [p.path.name for p in list_parts(root / table / f"run_id={run}")]


def per_step_counts(root: Path, table: str = "rollouts") -> dict[int, int]:
    return dict(query(root, f"SELECT step, count(*) FROM {table} GROUP BY step")[1])


def checkpoint(root: Path, run: str, step: int) -> None:
    CheckpointStore(root).save(run, step, lambda d: (d / "w").write_text("x"), {"step": step})


# -- the plan: tiers and containment ---------------------------------------------------------------


def test_plan_tiles_the_closed_prefix_with_aligned_tiers():
    assert plan(98, 100) == []
    assert plan(99, 100) == [(0, 99)]
    assert plan(1549, 100) == [(0, 999), *[(lo, lo + 99) for lo in range(1000, 1500, 100)]]
    assert plan(1549, 100, final=True)[-1] == (1500, 1549)
    assert plan(9999, 100) == [(0, 9999)]  # 10,000 steps end as one file
    assert plan(4, 100, final=True) == [(0, 4)]
    with pytest.raises(ValueError, match="every: must be an integer >= 1"):
        plan(10, 0)


@pytest.mark.parametrize("every", [1, 2, 7, 100])
def test_every_later_block_contains_or_misses_each_earlier_one_and_files_stay_few(every):
    """As a run grows (any closed bound, final or not), the blocks of a later plan contain or are
    disjoint from every block an earlier plan made: a range never partly overlaps another."""
    rng = random.Random(every)
    made: set[tuple[int, int]] = set()
    upto = -1
    for _ in range(300):
        upto += rng.randint(1, 3 * every)
        blocks = plan(upto, every, final=rng.random() < 0.2)
        for lo, hi in blocks:
            for a, b in made:
                assert (lo <= a and b <= hi) or (a <= lo and hi <= b) or b < lo or hi < a, ((lo, hi), (a, b))
        made |= set(blocks)
        levels = 1
        while every * 10**levels <= upto + 1:
            levels += 1
        assert len(blocks) <= 9 * levels + 1
    assert len(plan(10_000 * every - 1, every)) == 1


# -- what readers see ------------------------------------------------------------------------------


def _parts(*spec: tuple[int, int, bool]) -> list[Part]:
    return [Part(lo, hi, r, Path(f"{lo}-{hi}-{r}")) for lo, hi, r in spec]


def test_select_hides_every_file_a_range_contains():
    parts = _parts((0, 9, True), (0, 4, True), (3, 3, False), (9, 9, False), (10, 10, False), (10, 10, True))
    visible, covered = select(parts)
    assert [(p.lo, p.hi, p.is_range) for p in visible] == [(0, 9, True), (10, 10, True)]
    assert {(p.lo, p.hi, p.is_range) for p in covered} == {(0, 4, True), (3, 3, False), (9, 9, False),
                                                             (10, 10, False)}  # fmt: skip
    with pytest.raises(StoreLayoutError, match="overlap without one containing the other"):
        select(_parts((0, 9, True), (5, 14, True)))


def test_temp_files_locks_and_foreign_names_are_never_listed(tmp_path):
    for name in ("step-000001.parquet", "range-000000-000009.parquet", ".range-000000-000009.parquet.x.tmp",
                 ".read.lock", "notes.txt", "range-000009-000000.parquet", "step-x.parquet"):  # fmt: skip
        (tmp_path / name).write_bytes(b"")
    assert [p.path.name for p in list_parts(tmp_path)] == [
        "range-000000-000009.parquet",
        "step-000001.parquet",
    ]


# -- compaction on real files ----------------------------------------------------------------------


def test_compaction_keeps_every_row_and_column_once(tmp_path):
    store = RolloutStore(tmp_path)
    write_steps(store, "r", range(25), metric_on=lambda s: {"checkpoint_seconds": 1.0} if s % 5 == 4 else {})
    # an older file without a column (rollouts' row_id was added later): still read, null there
    old = pq.read_table(store.step_path("rollouts", "r", 3)).drop_columns(["row_id"])
    pq.write_table(old, store.step_path("rollouts", "r", 3))
    sql = {t: f"SELECT * FROM {t} ORDER BY ALL" for t in ("rollouts", "rewards", "steps")}
    before = {t: query(tmp_path, q) for t, q in sql.items()}
    groups = store.read_groups("r")

    out = compact_run(tmp_path, "r", 24, 5)
    assert out["rollouts"] == {"files_before": 25, "files_after": 5, "ranges_written": 5, "files_removed": 25}
    assert names(tmp_path, "r", "steps") == [f"range-{lo:06d}-{lo + 4:06d}.parquet" for lo in range(0, 25, 5)]
    for t, q in sql.items():
        cols, rows = query(tmp_path, q)
        assert sorted(cols) == sorted(before[t][0]) and len(rows) == len(before[t][1]), t
        order = [cols.index(c) for c in before[t][0]]
        assert sorted(tuple(r[i] for i in order) for r in rows) == sorted(before[t][1]), t
    assert store.read_groups("r") == groups
    assert store.steps_written("rollouts", "r") == list(range(25))
    assert [g.group_id for g in store.read_groups("r", step=7)] == ["train-00000007"]
    assert [r["step"] for r in store.read_steps("r")] == list(range(25))

    write_steps(store, "r", range(25, 50))  # the next tier: ten 5-step blocks become one file
    compact_run(tmp_path, "r", 49, 5)
    assert names(tmp_path, "r") == ["range-000000-000049.parquet"]
    assert per_step_counts(tmp_path) == dict.fromkeys(range(50), PER_STEP)
    assert query(tmp_path, "SELECT count(checkpoint_seconds) FROM steps")[1] == [(5,)]


def test_compaction_never_goes_past_the_closed_steps(tmp_path):
    store = RolloutStore(tmp_path)
    write_steps(store, "r", range(12))
    assert compact_store(tmp_path, "r", every=2) == [
        {"run_id": "r", "skipped": "no closed step (no checkpoint, not completed)"}
    ]
    checkpoint(tmp_path, "r", 5)
    store.write_run_meta("r", {"status": "failed"})
    compact_store(tmp_path, "r", every=2)
    assert names(tmp_path, "r")[:3] == ["range-000000-000001.parquet", "range-000002-000003.parquet",
                                        "range-000004-000005.parquet"]  # fmt: skip
    assert names(tmp_path, "r")[3:] == [f"step-{s:06d}.parquet" for s in range(6, 12)]
    # A live run may still rewrite its checkpoint step's `steps` row: closed ends a step earlier.
    checkpoint(tmp_path, "r", 9)
    store.write_run_meta(
        "r", {"status": "running", "owner": identity(), "config": {"storage": {"compact_every": 2}}}
    )
    assert closed_through(tmp_path, "r") == (8, False)
    compact_store(tmp_path, "r")  # the run's own compact_every
    assert names(tmp_path, "r")[3:] == ["range-000006-000007.parquet"] + [
        f"step-{s:06d}.parquet" for s in range(8, 12)
    ]
    # Completed: every step is closed, and the tail past the last full block is merged too.
    store.write_run_meta("r", {"status": "completed"})
    assert closed_through(tmp_path, "r") == (11, True)
    compact_store(tmp_path, "r", every=4)
    assert names(tmp_path, "r") == ["range-000000-000003.parquet", "range-000004-000007.parquet",
                                    "range-000008-000011.parquet"]  # fmt: skip
    for table in ("rollouts", "rewards"):
        assert per_step_counts(tmp_path, table) == dict.fromkeys(range(12), PER_STEP)


def test_resume_deletes_steps_after_its_checkpoint_with_ranges_present(tmp_path):
    store = RolloutStore(tmp_path)
    write_steps(store, "r", range(10))
    compact_run(tmp_path, "r", 7, 4)  # ranges 0-3 and 4-7, step files 8 and 9
    (tmp_path / "rollouts" / "run_id=r" / ".range-000008-000009.parquet.dead.tmp").write_bytes(b"x")
    store.delete_steps_after("r", 5)  # as a resume from a step-5 checkpoint: 6.. are redone
    assert names(tmp_path, "r") == ["range-000000-000003.parquet", "range-000004-000005.parquet"]
    assert not list((tmp_path / "rollouts" / "run_id=r").glob(".*tmp"))
    for table in ("rollouts", "rewards"):
        assert per_step_counts(tmp_path, table) == dict.fromkeys(range(6), PER_STEP), table
    assert store.steps_written("steps", "r") == list(range(6))
    write_steps(store, "r", range(6, 10))  # the resumed run writes them again: each once
    assert per_step_counts(tmp_path) == dict.fromkeys(range(10), PER_STEP)
    store.delete_steps_after("r", -1)  # killed before its first checkpoint: everything goes
    assert per_step_counts(tmp_path) == {} and names(tmp_path, "r") == []


def test_files_a_reader_may_have_listed_are_deleted_only_after_it_is_done(tmp_path, monkeypatch):
    """A reader holds the read lock from listing to its last read: the compaction publishes its range
    meanwhile (the reader's answer is exact either way) but leaves the deletion; the next one does it."""
    monkeypatch.setattr(compact_mod, "DELETE_WAIT_S", 0.05)
    store = RolloutStore(tmp_path)
    write_steps(store, "r", range(4))
    with reading(tmp_path):
        compact_run(tmp_path, "r", 3, 4)
        parts = list_parts(tmp_path / "rollouts" / "run_id=r")
        assert len(parts) == 5 and len(select(parts)[0]) == 1  # published; its sources hidden, not deleted
    assert per_step_counts(tmp_path) == dict.fromkeys(range(4), PER_STEP)
    assert compact_run(tmp_path, "r", 3, 4)["rollouts"]["files_removed"] == 4
    assert names(tmp_path, "r") == ["range-000000-000003.parquet"]


def test_a_second_compactor_of_the_run_waits_for_the_first(tmp_path):
    store = RolloutStore(tmp_path)
    write_steps(store, "r", range(4))
    done = []
    with run_lock(tmp_path, "r"):
        t = threading.Thread(target=lambda: done.append(compact_run(tmp_path, "r", 3, 4)))
        t.start()
        t.join(0.5)
        assert t.is_alive() and len(names(tmp_path, "r")) == 4  # blocked on the run's lock
    t.join()
    assert names(tmp_path, "r") == ["range-000000-000003.parquet"] and done


def _compact_in_subprocess(root: Path, upto: int, every: int, faults: str) -> subprocess.CompletedProcess:
    code = (
        f"from grpoflow.storage.compact import compact_run; compact_run({str(root)!r}, 'r', {upto}, {every})"
    )
    env = {**os.environ, "GRPOFLOW_FAULTS": faults}
    return subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, timeout=120)


@pytest.mark.parametrize("point", ["compact_write", "compact_publish"])
def test_a_compaction_killed_midway_loses_and_duplicates_nothing(tmp_path, point):
    store = RolloutStore(tmp_path)
    write_steps(store, "r", range(20))
    compact_run(tmp_path, "r", 17, 2)  # nine 2-step ranges, step files 18 and 19
    # the next tier's merge (the nine ranges and two step files -> 0-19) is killed at `point`
    out = _compact_in_subprocess(tmp_path, 19, 2, f"{point}@1:kill")
    assert out.returncode == -signal.SIGKILL, out.stderr.decode()[-2000:]
    d = tmp_path / "rollouts" / "run_id=r"
    if point == "compact_write":  # written under its temp name: invisible, the sources read
        assert len(list(d.glob(".range-000000-000019.parquet.*.tmp"))) == 1
        assert len(names(tmp_path, "r")) == 11 and "range-000000-000019.parquet" not in names(tmp_path, "r")
    else:  # published, sources not yet deleted: they read as the range alone
        assert "range-000000-000019.parquet" in names(tmp_path, "r") and len(names(tmp_path, "r")) == 12
    for table, n in (("rollouts", PER_STEP), ("rewards", PER_STEP), ("steps", 1)):
        assert per_step_counts(tmp_path, table) == dict.fromkeys(range(20), n), table
    assert compact_run(tmp_path, "r", 19, 2)["rollouts"]["files_after"] == 1  # the next one cleans up
    assert names(tmp_path, "r") == ["range-000000-000019.parquet"] and not list(d.glob(".*tmp"))
    assert per_step_counts(tmp_path) == dict.fromkeys(range(20), PER_STEP)


def test_a_range_straddled_by_another_tiering_is_left_alone(tmp_path):
    store = RolloutStore(tmp_path)
    write_steps(store, "r", range(12))
    compact_run(tmp_path, "r", 11, 4)  # 0-3, 4-7, 8-11
    compact_run(tmp_path, "r", 11, 6)  # 0-5 would cut 4-7 in two: skipped; 6-11 too
    assert names(tmp_path, "r") == ["range-000000-000003.parquet", "range-000004-000007.parquet",
                                    "range-000008-000011.parquet"]  # fmt: skip
    assert per_step_counts(tmp_path) == dict.fromkeys(range(12), PER_STEP)


def test_background_compactor_runs_one_at_a_time_waits_on_close_and_logs_failures(tmp_path, caplog):
    store = RolloutStore(tmp_path)
    write_steps(store, "r", range(8))
    bg = BackgroundCompactor(tmp_path, "r", every=2)
    for s in range(1, 8, 2):
        bg.submit(s, final=s == 7)
    bg.close()
    # requests made while one ran were merged into the latest; the last one ran, with `final`
    assert not bg.errors and bg.results[-1]["upto"] == 7 and bg.results[-1]["final"]
    assert names(tmp_path, "r") == [f"range-{lo:06d}-{lo + 1:06d}.parquet" for lo in range(0, 8, 2)]
    assert per_step_counts(tmp_path) == dict.fromkeys(range(8), PER_STEP)
    # A failure is logged and kept, never raised; the files stay readable.
    bad = tmp_path / "rollouts" / "run_id=r" / "range-000003-000004.parquet"  # cuts 2-3 and 4-5
    pq.write_table(pa.table({"step": [3, 4]}), bad)
    bg = BackgroundCompactor(tmp_path, "r", every=2)
    with caplog.at_level(logging.WARNING, logger="grpoflow.compact"):
        bg.submit(9)
        bg.close()
    assert len(bg.errors) == 1 and "StoreLayoutError" in bg.errors[0]
    assert "compaction of r through step 9 failed" in caplog.text
    bad.unlink()
    off = BackgroundCompactor(tmp_path, "r", every=0)
    off.submit(9)
    off.close()
    assert off.results == [] and len(names(tmp_path, "r")) == 4  # off: nothing ran


def test_grpoflow_compact_compacts_closed_steps_of_one_or_every_run(tmp_path, capsys):
    from grpoflow.flows.cli.main import main

    store = RolloutStore(tmp_path)
    write_steps(store, "done", range(6))
    store.write_run_meta("done", {"status": "completed", "config": {"storage": {"compact_every": 0}}})
    write_steps(store, "young", range(3))  # no checkpoint yet: nothing is closed
    store.write_run_meta("young", {"status": "failed"})
    assert main(["compact", "young", "--root", str(tmp_path)]) == 0
    assert "young: skipped: no closed step" in capsys.readouterr().out
    assert main(["compact", "--root", str(tmp_path)]) == 0  # every run; `done` turned it off: unit 100
    out = capsys.readouterr().out
    assert "done: closed through step 5: files rollouts 6 -> 1, rewards 6 -> 1, steps 6 -> 1" in out
    assert names(tmp_path, "done") == ["range-000000-000005.parquet"] and len(names(tmp_path, "young")) == 3
    for argv, msg in ((["compact", "--every", "0"], "error: --every: must be an integer >= 1, got 0"),
                      (["compact", "ghost"], "error: RUN: no run 'ghost' under"),
                      (["compact", "../x"], "error: invalid run id '../x'")):  # fmt: skip
        assert main([*argv, "--root", str(tmp_path)]) == 2
        assert msg in capsys.readouterr().err

"""RolloutStore and checkpoints: real Parquet files, real DuckDB, atomicity under failure."""

from __future__ import annotations

from pathlib import Path

import pyarrow.parquet as pq
import pytest

from grpoflow.storage.checkpoints import CheckpointStore, weights_store
from grpoflow.storage.ids import validate_run_id
from grpoflow.storage.rollouts import RolloutStore
from grpoflow.storage.sql import query
from tests.support import rich_group

pytestmark = pytest.mark.unit


def test_records_round_trip_unchanged(tmp_path):
    store = RolloutStore(tmp_path)
    g = rich_group()
    store.write_rollouts("run1", 0, [g])
    store.write_rewards("run1", 0, [g])
    (back,) = store.read_groups("run1")
    g.row = {}  # dataset columns live in the dataset, not the rollouts table
    assert back == g


def test_rewriting_a_step_replaces_its_file(tmp_path):
    store = RolloutStore(tmp_path)
    store.write_rollouts("r", 2, [rich_group("a")])
    store.write_rollouts("r", 2, [rich_group("b")])
    _, rows = query(tmp_path, "SELECT group_id, count(*) FROM rollouts GROUP BY ALL")
    assert rows == [("b", 2)]
    assert store.steps_written("rollouts", "r") == [2]


def test_an_interrupted_write_leaves_no_visible_file(tmp_path, monkeypatch):
    store = RolloutStore(tmp_path)
    store.write_rollouts("r", 0, [rich_group()])

    def half_then_die(table, where, **kw):
        with open(where, "wb") as f:
            f.write(b"PAR1 partial bytes")
        raise KeyboardInterrupt("killed mid-write")

    monkeypatch.setattr(pq, "write_table", half_then_die)
    with pytest.raises(KeyboardInterrupt):
        store.write_rollouts("r", 1, [rich_group()])
    monkeypatch.undo()
    assert store.steps_written("rollouts", "r") == [0]
    assert not list((tmp_path / "rollouts" / "run_id=r").glob(".*"))  # temp file cleaned up
    _, rows = query(tmp_path, "SELECT count(*) FROM rollouts")
    assert rows == [(2,)]


def test_steps_table_columns_union_across_runs(tmp_path):
    store = RolloutStore(tmp_path)
    store.write_step("a", 0, {"loss": 1.0, "flag": True, "note": "text is not a metric", "nan": float("nan")})
    store.write_step("b", 0, {"loss": 2.0, "extra": 3})
    _, rows = query(tmp_path, "SELECT run_id, loss, flag, extra, nan FROM steps ORDER BY run_id")
    assert rows == [("a", 1.0, 1.0, None, None), ("b", 2.0, None, 3.0, None)]


def test_delete_steps_after_for_resume(tmp_path):
    store = RolloutStore(tmp_path)
    for s in range(4):
        store.write_rollouts("r", s, [rich_group()])
        store.write_step("r", s, {"loss": s})
    store.delete_steps_after("r", 1)
    assert store.steps_written("rollouts", "r") == [0, 1] and store.steps_written("steps", "r") == [0, 1]


@pytest.mark.parametrize("bad", ["../x", "a/b", ".hidden", "", "a..b", "x" * 200, "run id"])
def test_unsafe_run_ids_are_refused(tmp_path, bad):
    with pytest.raises(ValueError, match="invalid run id"):
        validate_run_id(bad)
    with pytest.raises(ValueError):
        RolloutStore(tmp_path).write_step(bad, 0, {})
    assert not any(tmp_path.iterdir()) or not (tmp_path.parent / "x").exists()


def test_run_metadata_is_atomic_json(tmp_path):
    store = RolloutStore(tmp_path)
    store.write_run_meta("r", {"status": "running"})
    assert store.read_run_meta("r") == {"status": "running"} and store.read_run_meta("other") is None
    assert store.runs() == ["r"]


def test_checkpoints_latest_retention_and_interrupted_save(tmp_path):
    ck = CheckpointStore(tmp_path)
    for step in (1, 3, 5):
        ck.save(
            "r",
            step,
            lambda d, s=step: (d / "w.bin").write_text(str(s)),
            {"policy_version": step},
            keep_last=2,
        )
    assert ck.list("r") == [3, 5]
    latest = ck.latest("r")
    assert latest.name == "step-000005" and (latest / "w.bin").read_text() == "5"
    assert CheckpointStore.load_state(latest) == {"policy_version": 5, "step": 5}

    def dies(d):
        (d / "w.bin").write_text("partial")
        raise RuntimeError("killed")

    with pytest.raises(RuntimeError):
        ck.save("r", 7, dies, {"policy_version": 7})
    assert ck.latest("r") == latest  # the previous checkpoint is still the latest, and intact
    # a temp dir left by a SIGKILLed writer is ignored and swept by the next save
    (tmp_path / "checkpoints" / "r" / ".step-000009.tmp-dead").mkdir()
    assert ck.latest("r") == latest
    ck.save("r", 9, lambda d: None, {})
    assert not [p for p in (tmp_path / "checkpoints" / "r").iterdir() if p.name.startswith(".")]


def test_a_checkpoint_reaches_the_disk_before_its_marker_and_its_rename(tmp_path, monkeypatch):
    # Every fsync, in order, by the path it synced (files and directories), with the marker's existence
    # at that moment; every rename. The writer's files (nested too) and their directories are synced
    # while no state.json exists; then the marker; then the rename publishes the whole directory.
    import os

    events = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd):
        path = Path(os.readlink(f"/proc/self/fd/{fd}"))
        tmp = next((q for q in [path, *path.parents] if q.name.startswith(".step-")), None)
        events.append(("fsync", path.name, tmp is not None and (tmp / "state.json").exists()))
        return real_fsync(fd)

    def replace(a, b):
        events.append(("rename", Path(a).name, Path(b).name))
        return real_replace(a, b)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)

    def writer(d):
        (d / "model.safetensors").write_bytes(b"w" * 64)
        (d / "optimizer").mkdir()
        (d / "optimizer" / "0.distcp").write_bytes(b"o" * 64)

    CheckpointStore(tmp_path).save("r", 1, writer, {"policy_version": 1})
    names = [e[1] for e in events]
    marker = names.index("state.json")
    before = {n for n, ok in [(e[1], not e[2]) for e in events[:marker]] if ok}
    assert {"model.safetensors", "0.distcp", "optimizer"} <= before  # synced while no marker existed
    assert events[-2][0] == "rename" and events[-2][2] == "step-000001"  # published after all of it
    assert marker < len(events) - 2
    # A weight version (read at once by the servers) syncs its marker, not the weights.
    events.clear()
    weights_store(tmp_path).save("r", 1, writer, {})
    assert [e[1] for e in events if e[0] == "fsync" and e[1] == "model.safetensors"] == []


def test_weight_versions_keep_last(tmp_path):
    w = weights_store(tmp_path)
    for v in range(4):
        w.save("r", v, lambda d: (d / "model.safetensors").write_bytes(b"x"), {"version": v}, keep_last=2)
    assert w.list("r") == [2, 3] and w.latest("r").name == "v000003"


def test_a_recycled_version_hands_its_files_to_the_next_and_never_the_served_one(tmp_path):
    from grpoflow.storage.checkpoints import PIN_FILE

    w = weights_store(tmp_path)
    seen = []

    def writer(d):
        seen.append(sorted(p.name for p in d.iterdir()))
        (d / "model.safetensors").write_bytes(b"x")

    w.save("r", 1, writer, {"version": 1}, recycle=2)
    w.save("r", 2, writer, {"version": 2}, recycle=2)
    inode = (w.path("r", 1) / "model.safetensors").stat().st_ino
    w.save("r", 3, writer, {"version": 3}, recycle=2)  # v1 goes: its dir becomes v3's
    assert seen == [[], [], ["model.safetensors"]]  # the old marker is gone before the writer runs
    assert w.list("r") == [2, 3] and (w.path("r", 3) / "model.safetensors").stat().st_ino == inode
    # keep 1: the newest (what the servers serve, the roll-back target) is never recycled
    assert w.recyclable("r", 1) == w.path("r", 2) and w.recyclable("r", 2) == w.path("r", 2)
    w.prune("r", 1)
    assert w.recyclable("r", 1) is None
    (w.path("r", 3) / f"{PIN_FILE}-x").touch()  # pinned by a promotion: kept
    w.save("r", 4, writer, {"version": 4}, recycle=1)
    assert w.list("r") == [3, 4] and seen[-1] == []


def test_saving_a_version_again_never_recycles_the_served_one(tmp_path):
    """A push whose load failed is retried with the same version: v3, which the servers still serve
    (and a restarted server reloads), must survive v4 being written a second time."""
    w = weights_store(tmp_path)
    for v in (2, 3, 4):  # v3 served; v4 written, its load failed
        w.save("r", v, lambda d: (d / "model.safetensors").write_bytes(b"x"), {"version": v}, recycle=2)
    assert w.list("r") == [3, 4]
    w.save("r", 4, lambda d: (d / "model.safetensors").write_bytes(b"y"), {"version": 4}, recycle=2)
    assert w.list("r") == [3, 4] and (w.path("r", 3) / "model.safetensors").read_bytes() == b"x"
    assert w.recyclable("r", 2, 4) is None and w.recyclable("r", 2, 5) == w.path("r", 3)

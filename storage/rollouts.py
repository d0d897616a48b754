"""RolloutStore: one Parquet file per (table, run, step), written atomically.

Layout (docs/architecture.md, section 5): `<root>/<table>/run_id=<run>/step-<NNNNNN>.parquet`, and
after compaction `range-<AAAAAA>-<BBBBBB>.parquet` files holding closed steps (storage/compact.py;
which files readers see: storage/layout.py). A file appears whole or not at all (temp name starting
with '.', fsync, os.replace), so readers never see a partial file; re-writing a step replaces its
file, so a resumed run never duplicates rows.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from grpoflow.storage.atomic import atomic_publish as _publish
from grpoflow.storage.atomic import (  # noqa: F401  (importable from here, as before)
    atomic_publish_dir,
    atomic_write_bytes,
    atomic_write_text,
    fsync_dir,
    fsync_tree,
)
from grpoflow.storage.faults import failpoint
from grpoflow.storage.ids import validate_run_id
from grpoflow.storage.layout import (
    Part,
    deleting,
    list_parts,
    reading,
    run_lock,
    select,
    step_name,
    visible_parts,
)
from grpoflow.storage.records import RolloutGroup
from grpoflow.storage.tables import (
    REWARDS_SCHEMA,
    ROLLOUTS_SCHEMA,
    STEPS_CORE_SCHEMA,
    groups_from_rows,
    reward_rows,
    rollout_rows,
)

TABLES = ("rollouts", "rewards", "steps")


def atomic_publish(path: Path, write: Callable[[Path], None], point: str | None = None) -> None:
    """storage/atomic.py's publish, with the failpoint `point` between writing and renaming."""
    _publish(path, write, (lambda: failpoint(point)) if point else None)


def atomic_write_parquet(path: Path, table: pa.Table) -> None:
    atomic_publish(path, lambda tmp: pq.write_table(table, tmp, compression="zstd"), "parquet_write")


def _metric_value(v: Any) -> float | None:
    if v is None:
        return None
    if isinstance(v, bool):
        return float(v)
    if isinstance(v, int | float):
        return float(v) if math.isfinite(v) else None
    return None


class RolloutStore:
    def __init__(self, root: str | Path):
        self.root = Path(root)

    # -- paths --------------------------------------------------------------------------------

    def table_dir(self, table: str, run_id: str) -> Path:
        if table not in TABLES:
            raise ValueError(f"unknown table {table!r}; expected one of {TABLES}")
        return self.root / table / f"run_id={validate_run_id(run_id)}"

    def step_path(self, table: str, run_id: str, step: int) -> Path:
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        return self.table_dir(table, run_id) / step_name(step)

    # -- writes -------------------------------------------------------------------------------

    def write_table(self, table: str, run_id: str, step: int, data: pa.Table) -> Path:
        path = self.step_path(table, run_id, step)
        atomic_write_parquet(path, data)
        return path

    def write_rollouts(self, run_id: str, step: int, groups: list[RolloutGroup]) -> Path:
        rows = rollout_rows(groups, run_id=run_id, step=step)
        return self.write_table("rollouts", run_id, step, pa.Table.from_pylist(rows, schema=ROLLOUTS_SCHEMA))

    def write_rewards(self, run_id: str, step: int, groups: list[RolloutGroup]) -> Path:
        rows = reward_rows(groups, run_id=run_id, step=step)
        return self.write_table("rewards", run_id, step, pa.Table.from_pylist(rows, schema=REWARDS_SCHEMA))

    def write_step(self, run_id: str, step: int, metrics: dict[str, Any]) -> Path:
        """One row: the core columns plus one float64 column per numeric metric (sorted by name)."""
        core = {
            "run_id": run_id,
            "step": step,
            "policy_version": int(metrics.get("policy_version", 0) or 0),
            "created_at": datetime.now(UTC),
        }
        fields = list(STEPS_CORE_SCHEMA)
        row = dict(core)
        for k in sorted(metrics):
            if k in core:
                continue
            v = metrics[k]
            if v is not None and _metric_value(v) is None and not isinstance(v, float):
                continue  # strings and nested values are not step metrics
            fields.append(pa.field(k, pa.float64()))
            row[k] = _metric_value(v)
        table = pa.Table.from_pylist([row], schema=pa.schema(fields))
        return self.write_table("steps", run_id, step, table)

    # -- reads --------------------------------------------------------------------------------

    def steps_written(self, table: str, run_id: str) -> list[int]:
        """The steps with rows in `table` (a compacted file's steps are read from its `step` column)."""
        with reading(self.root):
            return sorted({s for p in visible_parts(self.table_dir(table, run_id)) for s in _steps_in(p)})

    def _read(self, table: str, run_id: str, step: int | None) -> list[dict[str, Any]]:
        rows: list[dict[str, Any]] = []
        with reading(self.root):
            for p in visible_parts(self.table_dir(table, run_id)):
                if step is None:
                    rows.extend(pq.read_table(p.path).to_pylist())
                elif p.lo <= step <= p.hi:
                    filters = [("step", "=", step)] if p.is_range else None
                    rows.extend(pq.read_table(p.path, filters=filters).to_pylist())
        return rows

    def read_groups(
        self, run_id: str, step: int | None = None, split: str | None = None
    ) -> list[RolloutGroup]:
        rollouts = self._read("rollouts", run_id, step)
        rewards = self._read("rewards", run_id, step)
        if split is not None:
            rollouts = [r for r in rollouts if r["split"] == split]
        return groups_from_rows(rollouts, rewards)

    def read_steps(self, run_id: str) -> list[dict[str, Any]]:
        return self._read("steps", run_id, None)

    def runs(self) -> list[str]:
        found = set()
        for table in TABLES:
            d = self.root / table
            if d.is_dir():
                found |= {p.name.split("=", 1)[1] for p in d.glob("run_id=*") if p.is_dir()}
        meta = self.root / "runs"
        if meta.is_dir():
            found |= {p.stem for p in meta.glob("*.json")}
        return sorted(found)

    def delete_steps_after(self, run_id: str, step: int) -> list[Path]:
        """Remove every table's rows of steps > `step` (a resumed run redoes those steps), the temp
        files a killed writer or compaction left behind (never visible to readers, but they take
        space), and files a published compacted range superseded.

        A compacted range reaching past `step` (compaction stops at the latest checkpoint, so only a
        store changed by other means has one) is rewritten with its steps <= `step` first."""
        removed: list[Path] = []
        with run_lock(self.root, run_id):
            for table in TABLES:
                d = self.table_dir(table, run_id)
                if not d.is_dir():
                    continue
                for tmp in [*d.glob(".step-*.tmp"), *d.glob(".range-*.tmp")]:
                    tmp.unlink(missing_ok=True)
                    removed.append(tmp)
                visible, covered = select(list_parts(d))
                for p in visible:
                    if p.is_range and p.lo <= step < p.hi:
                        kept = pq.read_table(p.path, filters=[("step", "<=", step)])
                        atomic_write_parquet(d / f"range-{p.lo:06d}-{step:06d}.parquet", kept)
                gone = covered + [p for p in visible if p.hi > step]
                with deleting(self.root):  # waits for readers in flight; new ones wait for it
                    for p in gone:
                        p.path.unlink(missing_ok=True)
                        removed.append(p.path)
                if gone:
                    fsync_dir(d)
        return removed

    # -- run metadata -------------------------------------------------------------------------

    def meta_path(self, run_id: str) -> Path:
        return self.root / "runs" / f"{validate_run_id(run_id)}.json"

    def write_run_meta(self, run_id: str, meta: dict[str, Any]) -> None:
        atomic_write_text(self.meta_path(run_id), json.dumps(meta, indent=2, sort_keys=True, default=str))

    def read_run_meta(self, run_id: str) -> dict[str, Any] | None:
        p = self.meta_path(run_id)
        return json.loads(p.read_text()) if p.is_file() else None


def _steps_in(p: Part) -> set[int]:
    if not p.is_range:
        return {p.lo}
    return set(pq.read_table(p.path, columns=["step"]).column("step").to_pylist())

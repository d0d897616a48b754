"""The `rescores` table: reward cells a run's stored completions got later, from other reward functions
(`grpoflow rescore`, flows/lineage/rescore.py), beside the run's own cells, which never change.

One Parquet file per rescore, `<root>/rescores/run_id=<run>/step-<NNNNNN>.parquet` (NNNNNN = the
rescore's version, 1, 2, ... per run: a counter, as promotions' decisions are), holding every cell of
that rescore: the `rewards` table's columns, plus `rescore` (its name), `version` and `created_at`. The
`rescores` SQL view reads them; `grpoflow sql --canned rescore_disagreements --run RUN` compares them
with the run's own rewards.
"""

from __future__ import annotations

import fcntl
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pyarrow as pa

from grpoflow.storage.ids import validate_run_id
from grpoflow.storage.layout import list_parts, step_name
from grpoflow.storage.rollouts import atomic_write_parquet
from grpoflow.storage.tables import REWARDS_SCHEMA

RESCORES_SCHEMA = pa.schema(
    [
        *REWARDS_SCHEMA,
        ("rescore", pa.string()),
        ("version", pa.int64()),
        ("created_at", pa.timestamp("us", tz="UTC")),
    ]
)


def rescores_dir(root: str | Path, run_id: str) -> Path:
    return Path(root) / "rescores" / f"run_id={validate_run_id(run_id)}"


def write_rescore(root: str | Path, run_id: str, name: str, cells: list[dict[str, Any]]) -> tuple[int, Path]:
    """Publish `cells` (rows of the rewards table) as run `run_id`'s next rescore, named `name`: the
    file appears whole or not at all, and two rescores at once get different versions."""
    d = rescores_dir(root, run_id)
    d.mkdir(parents=True, exist_ok=True)
    with open(d / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        version = max((p.hi for p in list_parts(d)), default=0) + 1
        now = datetime.now(UTC)
        rows = [{**c, "rescore": name, "version": version, "created_at": now} for c in cells]
        path = d / step_name(version)
        atomic_write_parquet(path, pa.Table.from_pylist(rows, schema=RESCORES_SCHEMA))
    return version, path

"""The promotion log: every gated, manual or rolled-back change of the policy a lineage serves.

One Parquet file per decision, `<root>/promotions/run_id=<lineage>/step-<NNNNNN>.parquet` (NNNNNN = the
decision's number in its lineage), written atomically like the other tables and read by the
`promotions` SQL view. Each row says what the server serves after it (`serving_*`): the lineage's
promoted versions form a stack (a promotion pushes, a rollback pops back to the version below, a
rejection changes nothing), and an empty stack serves the base model.

Checkpoints on a lineage's stack are pinned (a `PINNED-<lineage>` file in the checkpoint dir):
`run.keep_checkpoints` never prunes the version being served or any rollback target below it. A
version popped by a rollback is unpinned once no entry of that lineage's stack refers to it. (The
live server loads a promoted version from its checkpoint's `model/` dir, so `sync.keep_last`, which
prunes the training pushes' copies, never holds one.)
"""

from __future__ import annotations

import fcntl
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Literal

import pyarrow as pa
import pyarrow.parquet as pq

from grpoflow.storage.checkpoints import PIN_FILE, STATE_FILE
from grpoflow.storage.ids import validate_run_id
from grpoflow.storage.layout import step_name
from grpoflow.storage.rollouts import atomic_write_parquet, atomic_write_text

Decision = Literal["promoted", "rejected", "rolled_back"]

PROMOTIONS_SCHEMA = pa.schema(
    [
        ("lineage", pa.string()),
        ("decision_id", pa.int64()),
        ("decision", pa.string()),
        ("reason", pa.string()),
        ("metric", pa.string()),
        ("margin", pa.float64()),
        ("candidate_run", pa.string()),
        ("candidate_step", pa.int64()),
        ("candidate_path", pa.string()),
        ("candidate_score", pa.float64()),
        ("incumbent_run", pa.string()),
        ("incumbent_step", pa.int64()),
        ("incumbent_path", pa.string()),
        ("incumbent_score", pa.float64()),
        ("serving_run", pa.string()),
        ("serving_step", pa.int64()),
        ("serving_path", pa.string()),
        ("server", pa.string()),
        ("flow_run_id", pa.string()),
        ("created_at", pa.timestamp("us", tz="UTC")),
    ]
)


class PromotionError(RuntimeError):
    """A promotion or rollback that cannot be done (the message says why); nothing was changed."""


def version(run: str | None, step: int | None, path: str) -> dict[str, Any]:
    """A servable version: a checkpoint (run, step, its model dir) or the base model (run None)."""
    return {"run": run, "step": step, "path": str(path)}


class PromotionLog:
    def __init__(self, root: str | Path):
        self.root = Path(root)

    def lineage_dir(self, lineage: str) -> Path:
        return self.root / "promotions" / f"run_id={validate_run_id(lineage)}"

    @contextmanager
    def locked(self, lineage: str) -> Iterator[None]:
        """Serialise decisions of one lineage (a retrain and a manual rollback, say) across processes."""
        d = self.lineage_dir(lineage)
        d.mkdir(parents=True, exist_ok=True)
        with open(d / ".lock", "w") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(f, fcntl.LOCK_UN)

    def history(self, lineage: str) -> list[dict[str, Any]]:
        d = self.lineage_dir(lineage)
        files = sorted(d.glob("step-*.parquet")) if d.is_dir() else []
        rows = [r for p in files for r in pq.read_table(p).to_pylist()]
        return sorted(rows, key=lambda r: r["decision_id"])

    def stack(self, lineage: str) -> list[dict[str, Any]]:
        """The promoted versions still in force, oldest first; the last one is served."""
        out: list[dict[str, Any]] = []
        for r in self.history(lineage):
            if r["decision"] == "promoted":
                out.append(version(r["candidate_run"], r["candidate_step"], r["candidate_path"]))
            elif r["decision"] == "rolled_back" and out:
                out.pop()
        return out

    def serving(self, lineage: str) -> dict[str, Any] | None:
        """What the lineage's server should serve: its last decision's `serving_*` (None: no decision
        yet, so the base model)."""
        h = self.history(lineage)
        if not h:
            return None
        last = h[-1]
        return version(last["serving_run"], last["serving_step"], last["serving_path"])

    def record(
        self,
        lineage: str,
        decision: Decision,
        *,
        candidate: dict[str, Any] | None,
        incumbent: dict[str, Any] | None,
        serving: dict[str, Any],
        reason: str,
        metric: str | None = None,
        margin: float | None = None,
        candidate_score: float | None = None,
        incumbent_score: float | None = None,
        server: str | None = None,
        flow_run_id: str | None = None,
    ) -> dict[str, Any]:
        """Append one decision (call under `locked`); the row written."""
        n = len(self.history(lineage))
        cand, inc = candidate or {}, incumbent or {}
        row = {
            "lineage": lineage,
            "decision_id": n,
            "decision": decision,
            "reason": reason,
            "metric": metric,
            "margin": margin,
            "candidate_run": cand.get("run"),
            "candidate_step": cand.get("step"),
            "candidate_path": cand.get("path"),
            "candidate_score": candidate_score,
            "incumbent_run": inc.get("run"),
            "incumbent_step": inc.get("step"),
            "incumbent_path": inc.get("path"),
            "incumbent_score": incumbent_score,
            "serving_run": serving["run"],
            "serving_step": serving["step"],
            "serving_path": serving["path"],
            "server": server,
            "flow_run_id": flow_run_id,
            "created_at": datetime.now(UTC),
        }
        path = self.lineage_dir(lineage) / step_name(n)
        atomic_write_parquet(path, pa.Table.from_pylist([row], schema=PROMOTIONS_SCHEMA))
        return row


def pin(model_dir: str | Path, lineage: str) -> None:
    """Keep the checkpoint holding this model dir from retention (a base model dir is not pruned)."""
    ckpt = Path(model_dir).parent
    if (ckpt / STATE_FILE).is_file():
        atomic_write_text(ckpt / f"{PIN_FILE}-{validate_run_id(lineage)}", "promoted\n")


def unpin(model_dir: str | Path, lineage: str) -> None:
    ckpt = Path(model_dir).parent
    if (ckpt / STATE_FILE).is_file():
        (ckpt / f"{PIN_FILE}-{validate_run_id(lineage)}").unlink(missing_ok=True)

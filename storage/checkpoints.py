"""Atomic checkpoint directories, latest-checkpoint lookup and retention.

`<root>/checkpoints/<run>/step-<NNNNNN>/` and `<root>/weights/<run>/v<NNNNNN>/` are both "versioned
atomic directories": a writer fills a hidden temp dir in the same parent, a marker file is written
last, and one rename publishes it. A killed process leaves only a temp dir, which the next save
sweeps away; `latest()` only ever returns complete directories. Checkpoints are durable too: every
file the writer wrote (model, adapter, optimizer, kept batches) is fsynced before the marker is written
(`storage.rollouts.fsync_tree`, as `atomic_publish_dir` does), so a power loss cannot leave a marker
over files that never reached the disk. Weight pushes skip that: a version is read at once by the
servers and never outlives the run's next push.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from grpoflow.storage.faults import failpoint
from grpoflow.storage.ids import validate_run_id
from grpoflow.storage.rollouts import fsync_dir, fsync_tree

STATE_FILE = "state.json"
PIN_FILE = (
    "PINNED"  # `PINNED-<lineage>` files: a promoted version or a rollback target (storage/promotions.py)
)


def pinned(path: Path) -> bool:
    """Whether a version dir is pinned by some lineage's promotions (retention never removes it)."""
    return any(path.glob(f"{PIN_FILE}-*"))


class VersionedDirs:
    """Directories `<base>/<run>/<prefix><NNNNNN>/`, each published atomically with a marker file."""

    def __init__(
        self,
        base: Path,
        prefix: str,
        marker: str = STATE_FILE,
        failpoint: str | None = None,
        durable: bool = False,
    ):
        self.base, self.prefix, self.marker = Path(base), prefix, marker
        self.failpoint = failpoint  # storage.faults point hit just before publishing
        self.durable = durable  # fsync the writer's files before the marker (checkpoints)

    def run_dir(self, run_id: str) -> Path:
        return self.base / validate_run_id(run_id)

    def path(self, run_id: str, n: int) -> Path:
        return self.run_dir(run_id) / f"{self.prefix}{n:06d}"

    def list(self, run_id: str) -> list[int]:
        d = self.run_dir(run_id)
        if not d.is_dir():
            return []
        out = []
        for p in d.iterdir():
            name = p.name
            if (
                name.startswith(self.prefix)
                and name[len(self.prefix) :].isdigit()
                and (p / self.marker).is_file()
            ):
                out.append(int(name[len(self.prefix) :]))
        return sorted(out)

    def latest(self, run_id: str) -> Path | None:
        done = self.list(run_id)
        return self.path(run_id, done[-1]) if done else None

    def save(
        self,
        run_id: str,
        n: int,
        writer: Callable[[Path], None],
        marker_content: dict[str, Any],
        keep_last: int | None = None,
        recycle: int | None = None,
    ) -> Path:
        """Publish version `n` filled by `writer(dir)`, then keep the last `keep_last`. `recycle`: the
        dir of a version that keeping `recycle` versions would remove (`recyclable`) is handed to the
        writer with its files in it instead of an empty one."""
        final = self.path(run_id, n)
        final.parent.mkdir(parents=True, exist_ok=True)
        self.sweep_temp(run_id)
        tmp = final.with_name(f".{final.name}.tmp-{uuid.uuid4().hex[:8]}")
        old = self.recyclable(run_id, recycle, n) if recycle else None
        if old is not None:
            # Its files become the new version's: a writer that overwrites them in place reuses the
            # pages the filesystem already holds. Renamed first, so a kill leaves a temp dir.
            os.replace(old, tmp)
            (tmp / self.marker).unlink(missing_ok=True)
        else:
            tmp.mkdir()
        try:
            writer(tmp)
            if self.durable:
                fsync_tree(tmp)
            marker = tmp / self.marker
            with open(marker, "w") as f:
                json.dump(marker_content, f, indent=2, sort_keys=True, default=str)
                f.flush()
                os.fsync(f.fileno())
            fsync_dir(tmp)
            if self.failpoint:
                failpoint(self.failpoint)
            if final.exists():  # re-saving the same step: move the old one aside, then replace
                old = final.with_name(f".{final.name}.old-{uuid.uuid4().hex[:8]}")
                os.replace(final, old)
                os.replace(tmp, final)
                shutil.rmtree(old, ignore_errors=True)
            else:
                os.replace(tmp, final)
            fsync_dir(final.parent)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
        if keep_last is not None:
            self.prune(run_id, keep_last)
        return final

    def recyclable(self, run_id: str, keep_last: int, n: int | None = None) -> Path | None:
        """The oldest unpinned version that keeping `keep_last` after saving version `n` would remove;
        never the newest other than `n` (a server may be serving it, and a failed load rolls back to
        it). Saving `n` again (a push retried after its load failed) adds no version."""
        done = [v for v in self.list(run_id) if v != n]
        for v in done[: max(0, len(done) - max(keep_last - 1, 1))]:
            if not pinned(self.path(run_id, v)):
                return self.path(run_id, v)
        return None

    def prune(self, run_id: str, keep_last: int) -> list[int]:
        """Remove all but the last `keep_last` versions, except pinned ones; the numbers removed."""
        done = self.list(run_id)
        drop = [n for n in (done[:-keep_last] if keep_last > 0 else done) if not pinned(self.path(run_id, n))]
        for n in drop:
            # Renamed aside first: a kill mid-delete never leaves a marker beside missing files
            # (sweep_temp removes the rest).
            path = self.path(run_id, n)
            old = path.with_name(f".{path.name}.old-{uuid.uuid4().hex[:8]}")
            os.replace(path, old)
            shutil.rmtree(old, ignore_errors=True)
        return drop

    def sweep_temp(self, run_id: str) -> None:
        """Remove temp dirs left behind by a killed writer."""
        d = self.run_dir(run_id)
        if d.is_dir():
            for p in d.iterdir():
                if p.name.startswith(f".{self.prefix}") and (".tmp-" in p.name or ".old-" in p.name):
                    shutil.rmtree(p, ignore_errors=True)


class CheckpointNotFoundError(LookupError):
    """A run has no checkpoint (`step` None), or none at `step`; `steps` are the ones it has. Callers
    word it for their own users."""

    def __init__(self, run_id: str, step: int | None, steps: list[int]):
        super().__init__(
            f"run {run_id!r} has no checkpoint" + (f" at step {step}" if step is not None else "")
        )
        self.run_id, self.step, self.steps = run_id, step, steps


class CheckpointStore:
    """Training checkpoints: `<root>/checkpoints/<run>/step-<NNNNNN>/` with a `state.json`."""

    def __init__(self, root: str | Path):
        self.dirs = VersionedDirs(
            Path(root) / "checkpoints", "step-", failpoint="checkpoint_write", durable=True
        )

    def save(
        self,
        run_id: str,
        step: int,
        writer: Callable[[Path], None],
        state: dict[str, Any],
        keep_last: int | None = None,
    ) -> Path:
        return self.dirs.save(run_id, step, writer, {**state, "step": step}, keep_last)

    def latest(self, run_id: str) -> Path | None:
        return self.dirs.latest(run_id)

    def list(self, run_id: str) -> list[int]:
        return self.dirs.list(run_id)

    def at(self, run_id: str, step: int | None = None) -> tuple[Path, int]:
        """(dir, step) of run `run_id`'s checkpoint at `step` (default: its latest); else a
        CheckpointNotFoundError with the steps the run has."""
        steps = self.list(run_id)
        if not steps:
            raise CheckpointNotFoundError(run_id, None, steps)
        if step is None:
            step = steps[-1]
        elif step not in steps:
            raise CheckpointNotFoundError(run_id, step, steps)
        return self.dirs.path(run_id, step), step

    @staticmethod
    def load_state(path: Path) -> dict[str, Any]:
        return json.loads((Path(path) / STATE_FILE).read_text())


def weights_store(root: str | Path) -> VersionedDirs:
    """Weights pushed to vLLM: `<root>/weights/<run>/v<NNNNNN>/` (marker `version.json`)."""
    return VersionedDirs(Path(root) / "weights", "v", marker="version.json")

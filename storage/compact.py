"""Compaction: a run's closed steps merged into few large files, per table, by step range.

One file per (table, run, step) makes SQL slow with run length rather than data (DuckDB opens every
file), so closed steps are merged into `range-<AAAAAA>-<BBBBBB>.parquet` (steps AAAAAA..BBBBBB
inclusive) in the same dir. Closed = can never be rewritten: steps up to the run's latest checkpoint
(a resume deletes only later steps) or every step of a completed run; compaction never goes past
that. Which files readers see while ranges and their sources coexist: storage/layout.py.

Tiers (`plan`): with unit E = `storage.compact_every` and FANOUT = 10, a level-k range covers an
aligned block of E * 10^(k-1) steps. The closed prefix is tiled greedily by the largest aligned
blocks that fit, so each level holds fewer than 10 ranges and 10,000 steps at E = 100 end as one
file per table; each row is rewritten once per level (log10 of the run length over E). Steps past
the last full block stay step files, except on a run's last compaction (`final`), which merges
them into one range that starts on a block boundary. Every range starts on a block boundary and a
larger block's start, so a later range always contains the earlier ones it replaces (containment,
never partial overlap). A block that some present file straddles (a run whose `compact_every`
changed to a value that does not divide the old one) is left alone.

Crash safety: a range is published by storage.rollouts.atomic_publish: written under a temp name ('.range-...tmp'), fsynced, renamed, the dir
fsynced, and only then are its sources deleted. Failpoints `compact_write` (written, not yet
renamed) and `compact_publish` (renamed, sources not yet deleted) let drills kill it there; the next
compaction or resume removes the temp file or the hidden sources.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from grpoflow.storage.checkpoints import CheckpointStore
from grpoflow.storage.faults import failpoint
from grpoflow.storage.ids import validate_run_id
from grpoflow.storage.layout import Part, deleting, list_parts, range_name, run_lock, select
from grpoflow.storage.processes import is_alive
from grpoflow.storage.rollouts import TABLES, RolloutStore, atomic_publish, fsync_dir

FANOUT = 10
DEFAULT_EVERY = 100  # `grpoflow compact` on a run whose config turned automatic compaction off
ROW_GROUP_ROWS = 65_536
ROW_GROUP_BYTES = 64 << 20
DELETE_WAIT_S = 5.0  # how long a compaction waits for readers in flight before leaving the deletes


def check_every(every: int, field: str = "storage.compact_every") -> int:
    if isinstance(every, bool) or not isinstance(every, int) or every < 1:
        raise ValueError(f"{field}: must be an integer >= 1 to compact, got {every!r}")
    return every


def plan(upto: int, every: int, *, final: bool = False, fanout: int = FANOUT) -> list[tuple[int, int]]:
    """The blocks (lo, hi) that tile steps 0..upto: greedily the largest aligned block of
    every * fanout^k steps that starts at the current step and ends by `upto`; then, if `final`,
    one block for the remaining steps."""
    check_every(every, "every")
    out, lo = [], 0
    while lo + every - 1 <= upto:
        size = every
        while lo % (size * fanout) == 0 and lo + size * fanout - 1 <= upto:
            size *= fanout
        out.append((lo, lo + size - 1))
        lo += size
    if final and lo <= upto:
        out.append((lo, upto))
    return out


def _conform(table: pa.Table, schema: pa.Schema) -> pa.Table:
    """`table` with `schema`'s columns in its order: missing ones null (a file written before the
    column existed, a steps metric logged only on some steps), others cast to the unified type."""
    n = table.num_rows
    cols = [
        table.column(f.name).cast(f.type) if f.name in table.column_names else pa.nulls(n, f.type)
        for f in schema
    ]
    return pa.Table.from_arrays(cols, schema=schema)


def write_range(d: Path, lo: int, hi: int, sources: list[Part]) -> Path:
    """Merge `sources` (in step order) into `range-lo-hi`, streamed one batch at a time (a large
    range never sits in memory whole), published atomically."""
    path = d / range_name(lo, hi)
    schema = pa.unify_schemas(
        [pq.read_schema(p.path) for p in sources], promote_options="permissive"
    ).remove_metadata()

    def write(tmp: Path) -> None:
        with pq.ParquetWriter(tmp, schema, compression="zstd") as writer:
            buf: list[pa.Table] = []
            rows = size = 0
            for p in sorted(sources):
                batches = pq.ParquetFile(p.path).iter_batches(batch_size=ROW_GROUP_ROWS, use_threads=False)
                for batch in batches:
                    buf.append(_conform(pa.Table.from_batches([batch]), schema))
                    rows, size = rows + batch.num_rows, size + batch.nbytes
                    if rows >= ROW_GROUP_ROWS or size >= ROW_GROUP_BYTES:
                        writer.write_table(pa.concat_tables(buf))
                        buf, rows, size = [], 0, 0
            if buf:
                writer.write_table(pa.concat_tables(buf))

    atomic_publish(path, write, "compact_write")
    failpoint("compact_publish")
    return path


def _remove(root: Path, d: Path, parts: list[Part]) -> int:
    """Delete superseded files, once no reader is in flight. Readers that keep the lock past
    DELETE_WAIT_S only delay the deletion: the files stay hidden behind their range until the next
    compaction or resume."""
    if not parts:
        return 0
    with deleting(root, timeout_s=DELETE_WAIT_S) as ok:
        if not ok:
            return 0
        for p in parts:
            p.path.unlink(missing_ok=True)
    fsync_dir(d)
    return len(parts)


def compact_dir(root: Path, d: Path, upto: int, every: int, final: bool) -> dict[str, int]:
    """Compact one table dir (the caller holds the run's lock)."""
    for tmp in d.glob(".range-*.tmp"):  # a killed compaction's; no other compactor runs now
        tmp.unlink(missing_ok=True)
    visible, covered = select(list_parts(d))
    before = len(visible)
    removed = _remove(root, d, covered)  # sources a killed compaction published but never deleted
    ranges = 0
    for lo, hi in plan(upto, every, final=final):
        inside = [p for p in visible if lo <= p.lo and p.hi <= hi]
        straddling = [p for p in visible if p.lo <= hi and p.hi >= lo and not (lo <= p.lo and p.hi <= hi)]
        if len(inside) < 2 or straddling:
            continue
        path = write_range(d, lo, hi, inside)
        removed += _remove(root, d, inside)
        visible = sorted([p for p in visible if p not in inside] + [Part(lo, hi, True, path)])
        ranges += 1
    return {
        "files_before": before,
        "files_after": len(visible),
        "ranges_written": ranges,
        "files_removed": removed,
    }


def compact_run(root: str | Path, run_id: str, upto: int, every: int, *, final: bool = False) -> dict:
    """Compact every table of `run_id` through step `upto` (which must be closed); per-table figures."""
    root, every = Path(root), check_every(every)
    store = RolloutStore(root)
    out: dict[str, Any] = {"run_id": validate_run_id(run_id), "upto": upto, "final": final}
    t0 = time.perf_counter()
    with run_lock(root, run_id):
        for table in TABLES:
            d = store.table_dir(table, run_id)
            if d.is_dir():
                out[table] = compact_dir(root, d, upto, every, final)
    out["seconds"] = round(time.perf_counter() - t0, 3)
    return out


def closed_through(root: str | Path, run_id: str) -> tuple[int | None, bool]:
    """(the last closed step or None, whether the run is complete) as the store records it.

    A live run may still rewrite its latest checkpoint step's `steps` row (it adds the checkpoint's
    time after publishing it), so for a run whose owner is alive (or on another host) closed ends
    one step earlier; the run's own compactions run after that rewrite and pass the step itself."""
    store = RolloutStore(root)
    meta = store.read_run_meta(run_id) or {}
    ckpts = CheckpointStore(root).list(run_id)
    if meta.get("status") == "completed":
        last = [p.hi for t in TABLES for p in select(list_parts(store.table_dir(t, run_id)))[0]]
        upto = max([*last, *ckpts], default=None)
        return upto, upto is not None
    if not ckpts:
        return None, False
    live = meta.get("status") == "running" and is_alive(meta.get("owner")) is not False
    return ckpts[-1] - (1 if live else 0), False


def run_every(root: str | Path, run_id: str) -> int:
    """The run's own `storage.compact_every`, or DEFAULT_EVERY when it has none or it is off."""
    meta = RolloutStore(root).read_run_meta(run_id) or {}
    every = ((meta.get("config") or {}).get("storage") or {}).get("compact_every")
    return every if isinstance(every, int) and not isinstance(every, bool) and every > 0 else DEFAULT_EVERY


def compact_store(root: str | Path, run_id: str | None = None, every: int | None = None) -> list[dict]:
    """`grpoflow compact [RUN]`: compact the closed steps of one run or of every run in the store."""
    if every is not None:
        check_every(every, "--every")
    store = RolloutStore(root)
    runs = [validate_run_id(run_id)] if run_id else store.runs()
    if run_id and run_id not in store.runs():
        raise ValueError(f"RUN: no run {run_id!r} under {root}")
    out = []
    for r in runs:
        upto, complete = closed_through(root, r)
        if upto is None or upto < 0:
            out.append({"run_id": r, "skipped": "no closed step (no checkpoint, not completed)"})
            continue
        out.append(compact_run(root, r, upto, every or run_every(root, r), final=complete))
    return out


class BackgroundCompactor:
    """A run's automatic compactions, one at a time on a daemon thread, off the training loop.

    `submit(upto)` asks for the closed steps through `upto`; a request made while one runs replaces
    any earlier pending one (each covers all closed steps). `close()` waits for the running and
    pending ones. A failure is logged and kept in `errors`, never raised: the files stay as they
    were, readable, and the next compaction tries again."""

    def __init__(self, root: str | Path, run_id: str, every: int, log: Any = None):
        self.root, self.run_id, self.every = Path(root), run_id, every
        self.log = log or logging.getLogger("grpoflow.compact")
        self.results: list[dict] = []
        self.errors: list[str] = []
        self._pending: tuple[int, bool] | None = None
        self._thread: threading.Thread | None = None
        self._cv = threading.Condition()

    def submit(self, upto: int, final: bool = False) -> None:
        if self.every <= 0 or upto < 0:
            return
        with self._cv:
            self._pending = (upto, final)
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="grpoflow-compact", daemon=True)
                self._thread.start()

    def _loop(self) -> None:
        # The lowest CPU priority for this thread (Linux: niceness is per thread; all the work is done
        # on it, reads included): on shared cores the learner and the server go first.
        if sys.platform.startswith("linux"):  # elsewhere the id would name a process, not this thread
            with contextlib.suppress(OSError):
                os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
        while True:
            with self._cv:
                if self._pending is None:
                    self._thread = None
                    return
                (upto, final), self._pending = self._pending, None
            try:
                res = compact_run(self.root, self.run_id, upto, self.every, final=final)
                self.results.append(res)
                self.log.debug("compacted %s through step %d in %.3f s", self.run_id, upto, res["seconds"])
            except Exception as e:  # a failed compaction leaves readable files; the run goes on
                self.errors.append(repr(e))
                self.log.warning("compaction of %s through step %d failed: %r", self.run_id, upto, e)

    def close(self) -> None:
        while True:
            with self._cv:
                t = self._thread
            if t is None:
                return
            t.join()

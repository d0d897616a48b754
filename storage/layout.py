"""Which files of a run's table dir readers see, and the locks that keep that view exact.

A table dir (`<root>/<table>/run_id=<run>/`) holds step files `step-<NNNNNN>.parquet` (one step) and
compacted files `range-<AAAAAA>-<BBBBBB>.parquet` (steps AAAAAA..BBBBBB inclusive, storage/compact.py).
Compaction only ever writes a range that *contains* every file it replaces (never a partial
overlap), so the ranges present form nested-or-disjoint intervals and the rule readers apply is:

    a file is visible unless a range present in the same dir contains its steps.

A range is published (renamed into place) before the files it replaces are deleted, so at every
instant the visible files hold each step's rows exactly once: before the rename the sources are
visible; after it the range hides them, whether or not they are deleted yet (a kill in between
leaves them hidden until the next compaction or resume removes them).

Listing a directory is not atomic: a reader scanning while a range is published and its sources
deleted could miss the range (not yet there when its entry was passed) and the sources (already
deleted): rows silently lost. A reader that listed just before the deletion would instead fail on a
vanished file. So deletion and reading exclude each other with `<root>/.read.lock`:

- readers (SQL views, RolloutStore reads) hold it shared from listing to the last read (`reading`);
- deleters (compaction removing superseded files, a resume removing steps after its checkpoint) hold
  it exclusive for the unlinks only (`deleting`), never while writing a range;
- `<root>/.read.gate` lets a waiting deleter through a stream of readers: readers pass the gate
  (shared, released at once) before taking the read lock, and a deleter holds the gate exclusive
  while it waits, so new readers queue behind it instead of starving it.

Publishing needs no lock: a rename is atomic, and either answer of the listing is exact. A
retry-on-vanished-file scheme alone would not do: it cannot see the silent miss above. A grace delay
before deleting would only make the miss unlikely. Compactors of one run exclude each other, and a
resume, with a per-run lock (`run_lock`).
"""

from __future__ import annotations

import bisect
import errno
import fcntl
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

READ_LOCK = ".read.lock"
READ_GATE = ".read.gate"


class StoreLayoutError(RuntimeError):
    """Two compacted ranges of one dir overlap without one containing the other: compaction never
    writes that, so the dir was changed by hand; reading on would count some steps twice."""


@dataclass(frozen=True, order=True)
class Part:
    """A published Parquet file of a table dir: steps lo..hi inclusive (lo == hi for a step file)."""

    lo: int
    hi: int
    is_range: bool
    path: Path


def step_name(step: int) -> str:
    """The file name of one step's rows (rollouts, rewards, steps; a lineage's promotion n)."""
    return f"step-{step:06d}.parquet"


def range_name(lo: int, hi: int) -> str:
    return f"range-{lo:06d}-{hi:06d}.parquet"


def parse_name(name: str) -> tuple[int, int, bool] | None:
    """(lo, hi, is_range) of a published file name; None for anything else (temp files, locks)."""
    if name.startswith(".") or not name.endswith(".parquet"):
        return None
    parts = name[: -len(".parquet")].split("-")
    if len(parts) == 2 and parts[0] == "step" and parts[1].isdigit():
        return int(parts[1]), int(parts[1]), False
    if len(parts) == 3 and parts[0] == "range" and parts[1].isdigit() and parts[2].isdigit():
        lo, hi = int(parts[1]), int(parts[2])
        return (lo, hi, True) if lo <= hi else None
    return None


def list_parts(d: Path) -> list[Part]:
    """Every published file of the dir `d`, visible or not ([] when it does not exist)."""
    try:
        names = os.listdir(d)
    except FileNotFoundError:
        return []
    out = []
    for name in names:
        parsed = parse_name(name)
        if parsed is not None:
            out.append(Part(*parsed, d / name))
    return sorted(out)


def select(parts: list[Part]) -> tuple[list[Part], list[Part]]:
    """(visible, covered): visible files sorted by step, each step in at most one of them; covered:
    files contained in a present range (superseded, to be deleted)."""
    top: list[Part] = []  # the ranges no other range contains: disjoint, sorted
    covered: list[Part] = []
    for r in sorted((p for p in parts if p.is_range), key=lambda p: (p.lo, -p.hi)):
        if top and r.hi <= top[-1].hi:
            covered.append(r)
        elif top and r.lo <= top[-1].hi:
            raise StoreLayoutError(
                f"{r.path.parent}: {top[-1].path.name} and {r.path.name} overlap without one containing "
                "the other; remove the one that was not written by grpoflow compact"
            )
        else:
            top.append(r)
    los = [r.lo for r in top]
    steps = []
    for p in parts:
        if p.is_range:
            continue
        i = bisect.bisect_right(los, p.lo) - 1
        (covered if i >= 0 and top[i].hi >= p.hi else steps).append(p)
    return sorted(top + steps), sorted(covered)


def visible_parts(d: Path) -> list[Part]:
    return select(list_parts(d))[0]


# -- locks ----------------------------------------------------------------------------------------


def _open_lock(path: Path, create: bool) -> int | None:
    """A descriptor to flock `path`; None when it cannot be opened (a read-only store without one)."""
    try:
        return os.open(path, os.O_RDONLY | (os.O_CREAT if create else 0), 0o644)
    except FileNotFoundError:
        return None
    except OSError as e:
        if e.errno in (errno.EACCES, errno.EROFS, errno.EPERM) and create:
            return _open_lock(path, create=False)
        raise


@contextmanager
def reading(root: str | Path) -> Iterator[None]:
    """Hold the store's read lock shared: no superseded or deleted file disappears meanwhile.

    A reader that may not create the lock file (a read-only store where no compaction ever ran, so
    none exists) reads without it. Never nest a `deleting` of the same root inside: flock locks of
    one process conflict like any other's."""
    root = Path(root)
    gate = _open_lock(root / READ_GATE, create=root.is_dir())
    lock = _open_lock(root / READ_LOCK, create=root.is_dir())
    try:
        if gate is not None:
            fcntl.flock(gate, fcntl.LOCK_SH)  # waits while a deleter is queued or deleting
            os.close(gate)
            gate = None
        if lock is not None:
            fcntl.flock(lock, fcntl.LOCK_SH)
        yield
    finally:
        for fd in (gate, lock):
            if fd is not None:
                os.close(fd)


def _flock_within(fd: int, deadline: float | None) -> bool:
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            if deadline is not None and time.monotonic() >= deadline:
                return False
            time.sleep(0.005)


@contextmanager
def deleting(root: str | Path, timeout_s: float | None = None) -> Iterator[bool]:
    """Hold the read lock exclusive (no reader lists or reads meanwhile); yields whether it was taken
    within `timeout_s` (None: wait as long as it takes). Hold it for unlinks only."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    gate = os.open(root / READ_GATE, os.O_RDONLY | os.O_CREAT, 0o644)
    lock = os.open(root / READ_LOCK, os.O_RDONLY | os.O_CREAT, 0o644)
    try:
        yield _flock_within(gate, deadline) and _flock_within(lock, deadline)
    finally:
        os.close(lock)
        os.close(gate)


def run_lock_path(root: str | Path, run_id: str) -> Path:
    return Path(root) / "runs" / f".{run_id}.compact.lock"


@contextmanager
def run_lock(root: str | Path, run_id: str) -> Iterator[None]:
    """Exclusive among the compactions and resumes of one run (blocks until the other is done)."""
    path = run_lock_path(root, run_id)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDONLY | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)

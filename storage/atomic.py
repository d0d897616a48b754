"""The one home of atomic file operations: every Parquet file, checkpoint, weights dir and record appears
whole or not at all (written under a hidden temp name, fsynced, renamed, the directory fsynced).

It imports nothing of grpoflow, so that every module of storage (failpoints included, which record a
kill before it fires) may use it; storage/rollouts.py adds the failpoint between write and rename.
"""

from __future__ import annotations

import os
import shutil
import uuid
from collections.abc import Callable
from pathlib import Path


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(path: Path) -> None:
    """Every file under `path`, then every directory (deepest first, `path` last), on disk."""
    dirs = [path]
    for f in sorted(path.rglob("*")):
        if f.is_dir():
            dirs.append(f)
        elif f.is_file():
            with open(f, "rb+") as h:
                os.fsync(h.fileno())
    for d in reversed(dirs):
        fsync_dir(d)


def atomic_publish(
    path: Path, write: Callable[[Path], None], before_rename: Callable[[], None] | None = None
) -> None:
    """Publish the file `write(tmp)` writes as `path`, so that readers see the old file or the new one,
    never a mix: written under a hidden temp name, fsynced, renamed, the directory fsynced.
    `before_rename` runs between writing and renaming (a failpoint)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
    try:
        write(tmp)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        if before_rename is not None:
            before_rename()
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    fsync_dir(path.parent)


def atomic_publish_dir(path: Path, write: Callable[[Path], None]) -> Path:
    """Publish the directory `write(tmp)` fills as `path` (a model dir): readers see the old one or the
    whole new one, never a part: filled under a hidden temp name, every file and the directory
    fsynced, renamed into place (an existing one is moved aside first, then deleted)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
    old = path.with_name(f".{path.name}.{uuid.uuid4().hex}.old")
    try:
        tmp.mkdir()
        write(tmp)
        fsync_tree(tmp)
        if path.exists():
            os.replace(path, old)
        os.replace(tmp, path)
        fsync_dir(path.parent)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(old, ignore_errors=True)
    return path


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write `data` to `path` so that readers see the old file or the new one, never a mix."""
    atomic_publish(path, lambda tmp: tmp.write_bytes(data))


def atomic_write_text(path: Path, text: str) -> None:
    atomic_write_bytes(path, text.encode())

"""A test-only reader of W&B's offline transaction logs (`<dir>/wandb/[offline-]run-*/run-<id>.wandb`),
so that tests can check what the W&B tracker wrote. The format is W&B's private one: grpoflow itself
never reads it (its W&B tracker keeps its own cursor, flows/viewing/tracking/wandb_tracker.py), and a wandb
release that changes it breaks these tests, not a run. `test_wandb_reader_agrees_with_wandbs_own`
(tests/unit/test_tracking.py) checks it against wandb's own reader, `wandb leet inspect --json`."""

from __future__ import annotations

import json
import struct
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

_LOG_HEADER = struct.Struct("<4sHB")  # ident ":W&B", magic 0xBEE1, version 0
_RECORD_HEADER = struct.Struct("<IHB")  # crc32 of type + data, length, type
_BLOCK = 32768
_FULL, _FIRST, _MIDDLE, _LAST = 1, 2, 3, 4


def wandb_log_records(path: Path) -> Iterator[bytes]:
    """The records of a `.wandb` transaction log: W&B's header, then LevelDB's log format (32 KiB blocks
    of records, each checksummed with zlib's crc32 over its type byte and data; a record split across
    blocks as first/middle/last). wandb 0.31 no longer ships a Python reader of its own (the old
    `wandb.sdk.internal.datastore`), so this is the format as its writer, wandb-core, lays it out. A
    torn tail (a killed writer) ends the log: what is before it stands."""
    data = path.read_bytes()
    if len(data) < _LOG_HEADER.size or data[:4] != b":W&B":
        return
    pos, parts = _LOG_HEADER.size, []
    while pos + _RECORD_HEADER.size <= len(data):
        left = _BLOCK - pos % _BLOCK
        if left < _RECORD_HEADER.size:  # a block's zero trailer
            pos += left
            continue
        crc, n, kind = _RECORD_HEADER.unpack_from(data, pos)
        body = data[pos + _RECORD_HEADER.size : pos + _RECORD_HEADER.size + n]
        if len(body) < n or zlib.crc32(body, zlib.crc32(bytes([kind]))) != crc:
            return
        pos += _RECORD_HEADER.size + n
        if kind == _FULL:
            yield body
        elif kind == _FIRST:
            parts = [body]
        elif kind == _MIDDLE:
            parts.append(body)
        elif kind == _LAST:
            yield b"".join([*parts, body])
            parts = []


def wandb_log_files(path: str | Path, wandb_id: str | None = None) -> list[Path]:
    """The `.wandb` logs under `path` (a log, a run directory, a wandb directory or any folder above),
    of run `wandb_id` only if given, each session once (not again through `latest-run`), oldest first."""
    p = Path(path)
    if p.is_file():
        return [p]
    pattern = f"run-{wandb_id}.wandb" if wandb_id else "run-*.wandb"
    seen, files = set(), []
    for f in p.rglob(pattern):
        st = f.stat()
        if f.parent.is_symlink() or (st.st_ino, st.st_dev) in seen:
            continue
        seen.add((st.st_ino, st.st_dev))
        files.append(f)
    # Session dirs are named [offline-]run-<YYYYmmdd_HHMMSS>-<id>[-<n> when one started the same second].
    return sorted(files, key=lambda f: (f.parent.name.removeprefix("offline-"), len(f.parent.name)))


def wandb_history_rows(path: str | Path, wandb_id: str | None = None) -> list[tuple[int, dict[str, Any]]]:
    """Every history row in the `.wandb` logs under `path` (see `wandb_log_files`), in log order: (step,
    {key: value}), values decoded from their JSON, a logged dict (a table's reference) as a dict."""
    from wandb.proto.wandb_internal_pb2 import Record

    rows = []
    for f in wandb_log_files(path, wandb_id):
        for body in wandb_log_records(f):
            record = Record.FromString(body)
            if record.WhichOneof("record_type") != "history":
                continue
            row: dict[str, Any] = {}
            for item in record.history.item:
                keys = list(item.nested_key) or [item.key]
                at = row
                for k in keys[:-1]:
                    at = at.setdefault(k, {})
                at[keys[-1]] = json.loads(item.value_json)
            rows.append((record.history.step.num, row))
    return rows


def wandb_history(path: str | Path, wandb_id: str | None = None) -> dict[int, dict[str, Any]]:
    """The history of the W&B run(s) under `path`: step -> {key: value}, across resumed sessions."""
    out: dict[int, dict[str, Any]] = {}
    for step, row in wandb_history_rows(path, wandb_id):
        out.setdefault(step, {}).update(row)
    return out

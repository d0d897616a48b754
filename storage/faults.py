"""Failpoints: named places where crash-safety tests and benchmarks/faults.py inject faults.

They live in `storage`, the lowest layer, so that every layer can call them.

Inert unless the environment variable GRPOFLOW_FAULTS is set (one dict lookup per call otherwise).
Its value is a comma-separated list of `<point>[@<hit>]:<action>`:

    GRPOFLOW_FAULTS="parquet_write@5:kill"     SIGKILL this process at the 5th Parquet write
    GRPOFLOW_FAULTS="train:sleep=0.5"          every train step sleeps 0.5 s (a slow learner)
    GRPOFLOW_FAULTS="train@3:wait=/tmp/go"     the 3rd train step waits until the file /tmp/go exists

`hit` counts the calls of that point in this process (1-based); without it the action fires on every
call. Actions: `kill` (SIGKILL: no cleanup, no finally blocks, no flush: the worst crash there is),
`sleep=<seconds>`, and `wait=<path>` (hold there until that file exists: a test holds a run at a step
until it has done what must come first, instead of betting on how long a step takes).

With GRPOFLOW_FAULTS_RECORD=<dir> also set, a kill first records where it fired: one JSON file
`kill-<pid>-<point>@<hit>.json` ({"point", "hit", "pid"}) published atomically into that dir (the kill
drills of tests/drill.py point it at `<store>/faults/<run>`, beside the store's tables, never in
them), so that a drill reads from the store which moment it killed instead of trusting a clock.

Points, in the order a run reaches them:

    run_start         the run's record says `running` (flows/training/train.py), no server started, no step run
    generate          a group's completions are done (generation is still going for the others)
    score             the rewards of a batch are computed, not yet applied
    parquet_write     a Parquet file is written and fsynced under its temp name, not yet renamed
    train             a train step is about to run
    learner_rank      the last rank of a sharded learner (learner.world_size > 1) starts a train step
                      (the other ranks wait for it in their first collective)
    upload_chunk      a chunk of a version's file reached a server over the network (sync.transport),
                      the rest of the version not yet sent (tasks/push/upload.py)
    delta_chunk       the same, of a version sent as a delta (sync.delta; counted as upload_chunk too):
                      the server has part of what changed, and serves the version before it
    weight_push       new weights are saved and the server is paused, the reload not yet requested
    checkpoint_write  a checkpoint's files are written to its temp dir, not yet published
    checkpoint_done   a checkpoint is published; the step's other writes came before it
    compact_write     a compacted range is written and fsynced under its temp name, not yet renamed
                      (storage/compact.py; in a background thread, after a checkpoint)
    compact_publish   a compacted range is published; the files it replaces are not yet deleted
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections import Counter
from pathlib import Path

from grpoflow.storage.atomic import atomic_write_text

ENV = "GRPOFLOW_FAULTS"
RECORD_ENV = "GRPOFLOW_FAULTS_RECORD"
POINTS = (
    "run_start",
    "generate",
    "score",
    "parquet_write",
    "train",
    "learner_rank",
    "upload_chunk",
    "delta_chunk",
    "weight_push",
    "checkpoint_write",
    "checkpoint_done",
    "compact_write",
    "compact_publish",
)

_hits: Counter[str] = Counter()
_lock = threading.Lock()
_parsed: tuple[str, list[tuple[str, int | None, str, float | str]]] | None = None


def parse(spec: str) -> list[tuple[str, int | None, str, float | str]]:
    """`point[@hit]:action` items -> (point, hit, action, arg); a clear error names the bad item."""
    out = []
    for item in filter(None, (s.strip() for s in spec.split(","))):
        where, _, action = item.partition(":")
        point, _, hit = where.partition("@")
        if point not in POINTS:
            raise ValueError(f"{ENV}: unknown failpoint {point!r} in {item!r}; known: {', '.join(POINTS)}")
        if hit and not hit.isdigit():
            raise ValueError(f"{ENV}: hit count must be a positive integer in {item!r}")
        name, _, arg = action.partition("=")
        if name == "kill" and not arg:
            out.append((point, int(hit) if hit else None, "kill", 0.0))
        elif name == "sleep" and arg:
            out.append((point, int(hit) if hit else None, "sleep", float(arg)))
        elif name == "wait" and arg:
            out.append((point, int(hit) if hit else None, "wait", arg))
        else:
            raise ValueError(f"{ENV}: action must be 'kill', 'sleep=<seconds>' or 'wait=<path>' in {item!r}")
    return out


def failpoint(point: str) -> None:
    """Count a call of `point` and run the fault configured for it, if any."""
    spec = os.environ.get(ENV)
    if not spec:
        return
    global _parsed
    with _lock:
        if _parsed is None or _parsed[0] != spec:
            _parsed = (spec, parse(spec))
        _hits[point] += 1
        n = _hits[point]
        todo = [(a, arg) for p, hit, a, arg in _parsed[1] if p == point and hit in (None, n)]
    for action, arg in todo:
        if action == "kill":
            _record_kill(point, n)
            os.kill(os.getpid(), signal.SIGKILL)
        elif action == "wait":
            while not os.path.exists(arg):
                time.sleep(0.05)
        else:
            time.sleep(arg)


def _record_kill(point: str, hit: int) -> None:
    """Publish where this kill fires (GRPOFLOW_FAULTS_RECORD), whole or not at all, before it fires."""
    where = os.environ.get(RECORD_ENV)
    if not where:
        return
    pid = os.getpid()
    record = {"point": point, "hit": hit, "pid": pid}
    atomic_write_text(Path(where) / f"kill-{pid}-{point}@{hit}.json", json.dumps(record))

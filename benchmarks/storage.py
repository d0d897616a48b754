"""Storage benchmark: write synthetic rollout rows (~200 token ids each) as a run does, then query them.

Prints JSON lines:
- records_rows_per_s: RolloutStore.write_rollouts from RolloutGroup records (the training path),
  measured on --record-rows rows;
- then one line per (rows per step, layout), the store as a run leaves it: `per-step` (compaction
  off: one file per step) or `compacted` (storage.compact_every = --compact-every, a background
  compaction after every --checkpoint-every steps and at the end, as flows/training/train.py does):
  arrow_rows_per_s (atomic Parquet writes from Arrow columns), step_write_ms_* (one step's write on
  the loop: what a compaction running beside it costs the critical path), compact_seconds (the
  background compactions' total), wait_at_end_seconds (the last one, which the flow waits for),
  files, reward_curve_seconds (the canned reward-curve query over all rows), bytes_on_disk.

    .venv/bin/python benchmarks/storage.py [--rows 1000000] [--rows-per-step 10000[,...]]
                                           [--layouts per-step,compacted]
"""

from __future__ import annotations

import sys
from pathlib import Path

# This folder has a storage.py; keep it from shadowing the `storage` package when run as a script,
# and import this checkout's packages (not those an editable install of another checkout points to).
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import argparse
import json
import shutil
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

import numpy as np
import pyarrow as pa

from grpoflow.storage.compact import BackgroundCompactor
from grpoflow.storage.records import RolloutCompletion, RolloutGroup
from grpoflow.storage.rollouts import RolloutStore
from grpoflow.storage.sql import run_canned
from grpoflow.storage.tables import ROLLOUTS_SCHEMA

TOKENS = 200


def synthetic_groups(n_rows: int, group_size: int = 8) -> list[RolloutGroup]:
    rng = np.random.default_rng(0)
    groups = []
    for g in range(n_rows // group_size):
        comps = [
            RolloutCompletion(
                sample_index=i,
                completion="x" * TOKENS,
                completion_ids=rng.integers(0, 50_000, TOKENS).tolist(),
                completion_mask=[1] * TOKENS,
                logprobs=rng.normal(-2, 1, TOKENS).tolist(),
                reward=float(rng.random()),
                reward_valid=True,
            )
            for i in range(group_size)
        ]
        groups.append(RolloutGroup(f"train-{g:08d}", g, "prompt", [1] * 32, comps))
    return groups


def _list_col(values: np.ndarray, n: int, typ: pa.DataType) -> pa.Array:
    offsets = pa.array(np.arange(0, (n + 1) * TOKENS, TOKENS, dtype=np.int32))
    return pa.ListArray.from_arrays(offsets, pa.array(values, type=typ))


def arrow_step(run_id: str, step: int, n: int, rng: np.random.Generator) -> pa.Table:
    """One step's rows built column by column (no Python dicts), matching ROLLOUTS_SCHEMA."""
    cols = {}
    for f in ROLLOUTS_SCHEMA:
        cols[f.name] = pa.nulls(n, type=f.type)
    cols.update(
        run_id=pa.array([run_id] * n),
        split=pa.array(["train"] * n),
        step=pa.array(np.full(n, step)),
        policy_version=pa.array(np.full(n, step)),
        policy_version_end=pa.array(np.full(n, step)),
        staleness=pa.array(np.zeros(n, dtype=np.int64)),
        group_id=pa.array([f"g{step}-{i // 8}" for i in range(n)]),
        sample_index=pa.array((np.arange(n) % 8).astype(np.int32)),
        prompt_index=pa.array(np.arange(n) // 8),
        completion_ids=_list_col(rng.integers(0, 50_000, n * TOKENS, dtype=np.int32), n, pa.int32()),
        completion_mask=_list_col(np.ones(n * TOKENS, dtype=np.int8), n, pa.int8()),
        logprobs=_list_col(rng.normal(-2, 1, n * TOKENS).astype(np.float32), n, pa.float32()),
        completion_tokens=pa.array(np.full(n, TOKENS, dtype=np.int32)),
        reward=pa.array(rng.random(n)),
        reward_valid=pa.array(rng.random(n) > 0.1),
        truncated=pa.array(np.zeros(n, dtype=bool)),
        trained=pa.array(np.ones(n, dtype=bool)),
        created_at=pa.array([datetime.now(UTC)] * n, type=pa.timestamp("us", tz="UTC")),
    )
    return pa.table([cols[f.name].cast(f.type) for f in ROLLOUTS_SCHEMA], schema=ROLLOUTS_SCHEMA)


def write_run(root: Path, run_id: str, rows: int, per_step: int, compact_every: int, ckpt_every: int) -> dict:
    """Write `rows` rows in steps of `per_step` as a run does: one atomic file per step, and (with
    `compact_every`) a background compaction of the closed steps after every `ckpt_every`-th step
    (a checkpoint) and at the end, as flows/training/train.py does. The loop's time is the critical path."""
    rng = np.random.default_rng(1)
    store = RolloutStore(root)
    compactor = BackgroundCompactor(root, run_id, compact_every)
    steps = rows // per_step
    build = write = 0.0
    step_s = []
    t_loop = time.perf_counter()
    for s in range(steps):
        t0 = time.perf_counter()
        table = arrow_step(run_id, s, per_step, rng)
        t1 = time.perf_counter()
        store.write_table("rollouts", run_id, s, table)
        t2 = time.perf_counter()
        if (s + 1) % ckpt_every == 0 or s == steps - 1:
            compactor.submit(s, final=s == steps - 1)
        build, write = build + t1 - t0, write + t2 - t1
        step_s.append(time.perf_counter() - t1)
    loop = time.perf_counter() - t_loop
    t0 = time.perf_counter()
    compactor.close()
    assert not compactor.errors, compactor.errors
    step_s.sort()
    return {
        "arrow_rows_per_s": round(rows / write),
        "arrow_build_seconds": round(build, 2),
        "loop_seconds": round(loop, 2),
        "step_write_ms_p50": round(1000 * step_s[len(step_s) // 2], 2),
        "step_write_ms_p99": round(1000 * step_s[int(len(step_s) * 0.99)], 2),
        "step_write_ms_max": round(1000 * step_s[-1], 2),
        "compactions": len(compactor.results),
        "compact_seconds": round(sum(r["seconds"] for r in compactor.results), 2),
        "wait_at_end_seconds": round(time.perf_counter() - t0, 2),
    }


def measure(rows: int, per_step: int, layout: str, ckpt_every: int, compact_every: int) -> dict:
    root = Path(tempfile.mkdtemp(prefix="grpoflow-storage-"))
    try:
        every = compact_every if layout == "compacted" else 0
        fig = write_run(root, "bench", rows, per_step, every, ckpt_every)
        times = []
        for _ in range(3):
            t0 = time.perf_counter()
            _, out = run_canned(root, "reward_curve", "bench")
            times.append(time.perf_counter() - t0)
        assert len(out) == rows // per_step and all(r[-1] == per_step for r in out)
        return {
            "rows": rows,
            "rows_per_step": per_step,
            "steps": rows // per_step,
            "layout": layout,
            "files": sum(1 for _ in (root / "rollouts").rglob("*.parquet")),
            **fig,
            "reward_curve_seconds": round(min(times), 3),
            "reward_curve_seconds_cold": round(times[0], 3),
            "bytes_on_disk": sum(p.stat().st_size for p in root.rglob("*.parquet")),
        }
    finally:
        shutil.rmtree(root, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=1_000_000)
    ap.add_argument("--rows-per-step", default="10000", help="one or more, comma-separated (e.g. 64,640)")
    ap.add_argument("--layouts", default="per-step,compacted", help="per-step, compacted or both")
    ap.add_argument("--checkpoint-every", type=int, default=5, help="steps between background compactions")
    ap.add_argument("--compact-every", type=int, default=100, help="storage.compact_every")
    ap.add_argument("--record-rows", type=int, default=20_000)
    args = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="grpoflow-storage-"))
    try:
        t0 = time.perf_counter()
        RolloutStore(root).write_rollouts("records", 0, synthetic_groups(args.record_rows))
        print(json.dumps({"records_rows_per_s": round(args.record_rows / (time.perf_counter() - t0))}))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    for per_step in (int(x) for x in args.rows_per_step.split(",")):
        for layout in args.layouts.split(","):
            if layout not in ("per-step", "compacted"):
                ap.error(f"--layouts: unknown layout {layout!r}; use per-step, compacted")
            fig = measure(args.rows, per_step, layout, args.checkpoint_every, args.compact_every)
            print(json.dumps({"tokens_per_row": TOKENS, **fig}), flush=True)


if __name__ == "__main__":
    main()

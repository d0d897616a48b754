"""Storage benchmark: write 1,000,000 synthetic rollout rows (~200 token ids each) and query them.

Prints JSON:
- records_rows_per_s: RolloutStore.write_rollouts from RolloutGroup records (the training path),
  measured on --record-rows rows;
- arrow_rows_per_s: atomic Parquet writes of the same schema from Arrow columns, for all --rows rows
  in per-step files of --rows-per-step rows;
- reward_curve_seconds: the canned reward-curve query over all rows (target < 1 s);
- bytes_on_disk.

    .venv/bin/python benchmarks/storage.py [--rows 1000000] [--rows-per-step 10000]
"""

from __future__ import annotations

import sys
from pathlib import Path

# This folder has a storage.py; keep it from shadowing the `storage` package when run as a script.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]

import argparse
import json
import shutil
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

import numpy as np
import pyarrow as pa

from storage.records import ROLLOUTS_SCHEMA, RolloutCompletion, RolloutGroup
from storage.rollouts import RolloutStore
from storage.sql import run_canned

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


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=1_000_000)
    ap.add_argument("--rows-per-step", type=int, default=10_000)
    ap.add_argument("--record-rows", type=int, default=20_000)
    args = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="grpoflow-storage-"))
    store = RolloutStore(root)
    try:
        groups = synthetic_groups(args.record_rows)
        t0 = time.perf_counter()
        store.write_rollouts("records", 0, groups)
        records_rate = args.record_rows / (time.perf_counter() - t0)

        rng = np.random.default_rng(1)
        steps = args.rows // args.rows_per_step
        build = write = 0.0
        for s in range(steps):
            t0 = time.perf_counter()
            table = arrow_step("bench", s, args.rows_per_step, rng)
            t1 = time.perf_counter()
            store.write_table("rollouts", "bench", s, table)
            build, write = build + t1 - t0, write + time.perf_counter() - t1
        shutil.rmtree(root / "rollouts" / "run_id=records")
        times = []
        for _ in range(3):
            t0 = time.perf_counter()
            _, rows = run_canned(root, "reward_curve", "bench")
            times.append(time.perf_counter() - t0)
        assert len(rows) == steps
        size = sum(p.stat().st_size for p in root.rglob("*.parquet"))
        print(
            json.dumps(
                {
                    "rows": args.rows,
                    "tokens_per_row": TOKENS,
                    "files": steps,
                    "records_rows_per_s": round(records_rate),
                    "arrow_rows_per_s": round(args.rows / write),
                    "arrow_build_seconds": round(build, 2),
                    "write_seconds": round(write, 2),
                    "reward_curve_seconds": round(min(times), 3),
                    "reward_curve_seconds_cold": round(times[0], 3),
                    "bytes_on_disk": size,
                }
            )
        )
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()

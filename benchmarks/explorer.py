"""Rollout explorer benchmark: how fast each page of `grpoflow ui` answers on a long, compacted run.

Builds a store holding one synthetic run (default 10,000 steps x 64 rollout rows: groups of 8, two
reward functions with a mix of valid / invalid / failed / timeout cells, 150-200 token completions
with token ids, logprobs and masks, tool calls of which some failed, a held-out eval split every 50
steps, a `steps` row per step with a real run's metric columns, runs/<run>.json with a resolved
config), every row written through RolloutStore as a run writes it, then compacted by the real
compactor (`grpoflow compact`, storage.compact.compact_store: one range file per table at 10,000
steps, as a run with storage.compact_every 100 ends). Then serves flows/viewing/ui.py's app in-process on a
free loopback port and times each page's API calls over real HTTP.

    .venv/bin/python benchmarks/explorer.py [--steps 10000] [--rows-per-step 64] [--repeats 5]
                                            [--budget-ms 300] [--store DIR | --keep]

--store DIR builds the store there (or reuses it when it already holds this run at this size);
without it a temp dir is used, removed at the end unless --keep.

Prints JSON lines: {"machine": ...} (cores, Python, DuckDB ...), {"build": ...} (seconds: writing,
compacting), {"store": ...} (files and bytes per table), then one line per page: {"page", "median_ms",
"max_ms", "bytes", "first_ms"}: median and max of --repeats timings after one warm-up call (first_ms),
a page's calls fetched together as the page does; last {"budget_ms", "over_budget": [pages]}.
"""

from __future__ import annotations

import sys
from pathlib import Path

# This folder has a storage.py; keep it from shadowing the `storage` package when run as a script,
# and import this checkout's packages (not those an editable install of another checkout points to).
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import argparse
import asyncio
import json
import os
import platform
import shutil
import statistics
import tempfile
import time
from datetime import UTC, datetime, timedelta

import aiohttp
import duckdb
import numpy as np
import pyarrow as pa
from aiohttp import web

from grpoflow.flows.config import GRPOConfig
from grpoflow.flows.viewing.ui import make_app
from grpoflow.storage.compact import compact_store
from grpoflow.storage.rollouts import TABLES, RolloutStore
from grpoflow.storage.sql import query
from grpoflow.storage.tables import REWARDS_SCHEMA, ROLLOUTS_SCHEMA

RUN = "explorer-bench"
G = 8  # group size
REWARDS = (("correctness", 1.0), ("format", 0.5))
STATUSES, STATUS_P = ("valid", "invalid", "failed", "timeout"), (0.9, 0.05, 0.03, 0.02)
REASONS = {"valid": "", "invalid": "no final answer found", "failed": "ValueError: could not parse number",
           "timeout": "timed out after 30.0 s"}  # fmt: skip
EVAL_EVERY, EVAL_GROUPS = 50, 4
DATASET_ROWS = 7473  # train rows of the (synthetic) dataset: each is sampled ~every 934 steps at 8 per step
NEEDLE = "zanzibar"  # in ~0.5% of completions: what the text filter looks for
SERVERS = ("http://10.0.0.11:8000/v1", "http://10.0.0.12:8000/v1")
TOOLS = ("calculator", "python", "search")
_TEXT = """the a of to and is so we then first next total each number sum product answer step check left
right half twice three four five six seven eight nine ten hundred apples books cars minutes hours price
cost money dollars per more less than equal gives means therefore remaining count add subtract multiply
divide result value final boxed let us compute which because"""
WORDS = np.array(_TEXT.split())  # completions are drawn from these (NEEDLE is not among them)
PROMPT = (
    "<|im_start|>user\nProblem {n}: Natalia sold clips to {k} of her friends in April, and then she sold half "
    "as many clips in May. How many clips did Natalia sell altogether in April and May? Think step by step."
    "<|im_end|>\n<|im_start|>assistant\n"
)
TIME0 = datetime(2026, 11, 20, tzinfo=UTC)


def _lists(values: np.ndarray, lengths: np.ndarray, typ: pa.DataType) -> pa.Array:
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    return pa.ListArray.from_arrays(pa.array(offsets), pa.array(values, type=typ))


def step_tables(step: int, split: str, first: int, n_groups: int, steps: int,
                rng: np.random.Generator) -> tuple[pa.Table, pa.Table, dict]:  # fmt: skip
    """One split's rollouts and rewards at `step` for groups first..first+n_groups-1 (the data
    cursor), as Arrow tables matching the store's schemas, and the figures its `steps` row needs."""
    n = n_groups * G
    cursor = np.repeat(np.arange(first, first + n_groups), G)
    gids = [f"{split}-{c:08d}" for c in cursor]
    row_ids = [f"gsm8k-{split}-{c % DATASET_ROWS:05d}" for c in cursor]
    tokens = rng.integers(150, 201, n)
    calls = rng.choice(3, n, p=[0.7, 0.2, 0.1])
    truncated = tokens == 200
    texts, prompts, messages, turns, tool_calls, masks = [], [], [], [], [], []
    for i in range(n):
        words = WORDS[rng.integers(0, len(WORDS), int(tokens[i] * 0.75))].tolist()
        if rng.random() < 0.005:
            words.insert(int(rng.integers(0, len(words))), NEEDLE)
        parts = np.array_split(np.array(words), calls[i] + 1)
        mask = np.ones(tokens[i], dtype=np.int8)
        tcs, msgs = [], []
        for k, part in enumerate(parts):
            msgs.append({"role": "assistant", "content": " ".join(part), "is_completion": True})
            if k < calls[i]:
                failed = bool(rng.random() < 0.25)
                result = "" if failed else str(int(rng.integers(0, 1000)))
                tcs.append({"turn": k, "name": TOOLS[int(rng.integers(0, 3))], "arguments": '{"expr": "12 * 7 + 3"}',
                            "result": result, "failed": failed, "duration_s": float(rng.random() * 0.2),
                            "error": "ToolError: division by zero" if failed else None})  # fmt: skip
                msgs.append(
                    {"role": "tool", "content": result or "error: division by zero", "is_completion": False}
                )
                at = int(tokens[i] * (k + 1) / (calls[i] + 1))
                mask[at : at + 12] = 0  # the tool result's tokens: not the model's
        texts.append(" ".join(words))
        prompts.append(PROMPT.format(n=cursor[i] % DATASET_ROWS, k=cursor[i] % 97))
        messages.append(msgs)
        turns.append([{"prompt_tokens": 96 + 40 * k, "output_tokens": int(tokens[i] // (calls[i] + 1)),
                       "duration_s": float(rng.random()), "finish_reason": "length" if truncated[i] else "stop"}
                      for k in range(calls[i] + 1)])  # fmt: skip
        tool_calls.append(tcs)
        masks.append(mask)
    mask = np.concatenate(masks)
    logprobs = np.minimum(rng.normal(-1.0, 0.8, mask.size), 0).astype(np.float32) * mask

    # Reward cells: (row, function) row-major, as storage.tables.reward_rows writes them.
    status = rng.choice(len(STATUSES), (n, len(REWARDS)), p=STATUS_P)
    p_correct = 0.2 + 0.6 * step / max(1, steps - 1)  # a learning curve
    value = np.stack([(rng.random(n) < p_correct).astype(float), rng.beta(5, 2, n)], axis=1)
    value[status != 0] = np.nan
    weights = np.array([w for _, w in REWARDS])
    valid = (status == 0).all(axis=1)
    reward = np.where(valid, (np.nan_to_num(value) * weights).sum(axis=1), np.nan)
    r = reward.reshape(n_groups, G)
    ok = ~np.isnan(r)
    cnt = ok.sum(axis=1, keepdims=True)
    mean = np.where(ok, r, 0).sum(axis=1, keepdims=True) / np.maximum(cnt, 1)
    std = np.sqrt(np.where(ok, (r - mean) ** 2, 0).sum(axis=1, keepdims=True) / np.maximum(cnt, 1))
    adv = np.where(ok & (cnt >= 2) & (std > 0), (r - mean) / (std + 1e-4), 0.0).reshape(n)
    trained = valid & np.repeat(((cnt >= 2) & (std > 0)).reshape(n_groups), G)
    first_bad = [
        next((f"{REWARDS[j][0]}: {STATUSES[s]}" for j, s in enumerate(row) if s), None) for row in status
    ]
    drop = [None if t else (f"reward invalid: {b}" if b else "group filtered (zero reward variance)")
            for t, b in zip(trained, first_bad, strict=True)]  # fmt: skip
    staleness = rng.integers(0, 2, n) if split == "train" else np.zeros(n, dtype=np.int64)
    version = np.maximum(step - staleness, 0)
    created = TIME0 + timedelta(seconds=3 * step)
    rollouts = pa.table({
        "run_id": [RUN] * n, "split": [split] * n, "step": np.full(n, step), "policy_version": version,
        "policy_version_end": version, "server": [SERVERS[i % 2] for i in range(n)], "staleness": staleness,
        "group_id": gids, "sample_index": np.tile(np.arange(G, dtype=np.int32), n_groups), "prompt_index": cursor,
        "row_id": row_ids, "prompt": prompts,
        "prompt_ids": _lists(rng.integers(0, 50_000, 96 * n, dtype=np.int32), np.full(n, 96), pa.int32()),
        "messages": pa.array(messages, ROLLOUTS_SCHEMA.field("messages").type), "completion": texts,
        "completion_ids": _lists(rng.integers(0, 50_000, mask.size, dtype=np.int32), tokens, pa.int32()),
        "completion_mask": _lists(mask, tokens, pa.int8()), "logprobs": _lists(logprobs, tokens, pa.float32()),
        "completion_tokens": tokens.astype(np.int32), "num_turns": (calls + 1).astype(np.int32),
        "turns": pa.array(turns, ROLLOUTS_SCHEMA.field("turns").type),
        "tool_calls": pa.array(tool_calls, ROLLOUTS_SCHEMA.field("tool_calls").type),
        "truncated": truncated, "truncation_reason": ["max_tokens" if t else None for t in truncated],
        "finish_reason": ["length" if t else "stop" for t in truncated],
        "reward": pa.array(reward, from_pandas=True), "reward_valid": valid, "invalid_reason": first_bad,
        "advantage": adv, "trained": trained, "drop_reason": drop, "gen_seconds": rng.random(n) * 4,
        "created_at": pa.array([created] * n, pa.timestamp("us", tz="UTC")),
    }).cast(ROLLOUTS_SCHEMA)  # fmt: skip
    names = np.tile([name for name, _ in REWARDS], n)
    flat = status.reshape(-1)
    rewards = pa.table({
        "run_id": [RUN] * (2 * n), "split": [split] * (2 * n), "step": np.full(2 * n, step),
        "group_id": np.repeat(gids, 2), "sample_index": np.repeat(np.tile(np.arange(G), n_groups), 2),
        "reward_name": names, "weight": np.tile(weights, n), "value": pa.array(value.reshape(-1), from_pandas=True),
        "status": [STATUSES[s] for s in flat], "reason": [REASONS[STATUSES[s]] for s in flat],
        "duration_s": rng.random(2 * n) * 0.05, "imputed": np.zeros(2 * n, dtype=bool),
        "imputed_value": pa.nulls(2 * n, pa.float64()),
        "extra": [json.dumps({"parsed": str(int(v))}) if nm == "correctness" and s == 0 else None
                  for nm, s, v in zip(names, flat, np.nan_to_num(value.reshape(-1)), strict=True)],
    }).cast(REWARDS_SCHEMA)  # fmt: skip
    figures = {
        "reward/mean": float(np.nanmean(reward)) if valid.any() else None,
        "reward/std": float(np.nanstd(reward)) if valid.any() else None,
        "reward/valid_frac": float(valid.mean()),
    }
    for j, (name, _) in enumerate(REWARDS):
        col = value[:, j]
        figures[f"reward/{name}/mean"] = float(np.nanmean(col)) if (~np.isnan(col)).any() else None
    return (
        rollouts,
        rewards,
        figures | {"staleness_mean": float(staleness.mean()), "staleness_max": float(staleness.max())},
    )


def build(root: Path, steps: int, rows_per_step: int) -> dict:
    """Write the run step by step through RolloutStore, then compact it as `grpoflow compact` does."""
    store, rng = RolloutStore(root), np.random.default_rng(0)
    groups = rows_per_step // G
    cfg = GRPOConfig.model_validate({
        "data": {"prompts_per_step": groups, "eval_fraction": 0.05},
        "generation": {"group_size": G, "max_tokens": 200, "max_turns": 3},
        "rewards": [{"name": n, "fn": "grpoflow.examples.rewards:letter_fraction", "weight": w} for n, w in REWARDS],
        "run": {"run_id": RUN, "steps": steps, "eval_every": EVAL_EVERY, "eval_prompts": EVAL_GROUPS},
        "storage": {"root": str(root), "compact_every": 100},
    })  # fmt: skip
    meta = {"run_id": RUN, "status": "running", "created_at": TIME0.isoformat(), "updated_at": TIME0.isoformat(),
            "config": cfg.model_dump(mode="json"), "base_model": None, "flow_runs": []}  # fmt: skip
    store.write_run_meta(RUN, meta)
    t0 = time.perf_counter()
    for step in range(steps):
        rollouts, rewards, m = step_tables(step, "train", step * groups, groups, steps, rng)
        m |= {"policy_version": step, "train/loss": float(rng.normal(0, 0.05)), "train/policy_kl": 1e-3 * rng.random(),
              "train/mismatch_kl": 1e-4 * rng.random(), "train/clip_frac_low": 0.01 * rng.random(),
              "train/clip_frac_high": 0.02 * rng.random(), "gen_seconds": 2 + rng.random(),
              "train/seconds": 1 + rng.random(), "sync_seconds": 0.3 * rng.random(), "write_seconds": 0.02}  # fmt: skip
        if (step + 1) % EVAL_EVERY == 0 or step == steps - 1:  # eval rows land in the step's files
            ev_roll, ev_rew, ev = step_tables(step, "eval", 0, EVAL_GROUPS, steps, rng)
            rollouts, rewards = pa.concat_tables([rollouts, ev_roll]), pa.concat_tables([rewards, ev_rew])
            m |= {f"eval/{k}": v for k, v in ev.items() if k.startswith("reward/")} | {"eval_seconds": 5.0}
        m["wall_seconds"] = m["gen_seconds"] + m["train/seconds"] + m["sync_seconds"] + 0.05
        store.write_table("rollouts", RUN, step, rollouts)
        store.write_table("rewards", RUN, step, rewards)
        store.write_step(RUN, step, m)
        if step % 1000 == 999:
            print(
                f"# wrote {step + 1} steps in {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True
            )
    write_s = time.perf_counter() - t0
    store.write_run_meta(
        RUN, meta | {"status": "completed", "updated_at": (TIME0 + timedelta(seconds=3 * steps)).isoformat()}
    )
    t1 = time.perf_counter()
    [res] = compact_store(root, RUN)  # the run's compact_every (100); final: the whole run is closed
    assert "skipped" not in res, res
    return {"write_seconds": round(write_s, 1), "compact_seconds": round(time.perf_counter() - t1, 1)}


def holds_run(root: Path, steps: int, rows_per_step: int) -> bool:
    meta = RolloutStore(root).read_run_meta(RUN)
    if not meta or meta.get("status") != "completed":
        return False
    _, [(n, hi)] = query(root, "SELECT count(*), max(step) FROM rollouts WHERE split = 'train'")
    return n == steps * rows_per_step and hi == steps - 1 and not any(root.glob("*/run_id=*/step-*.parquet"))


def store_facts(root: Path) -> dict:
    out = {}
    for table in TABLES:
        files = list((root / table).rglob("*.parquet"))
        out[table] = {"files": len(files), "bytes": sum(p.stat().st_size for p in files)}
    return out


async def bench(root: Path, steps: int, repeats: int) -> list[dict]:
    """Serve the explorer on a free loopback port; time each page's calls over HTTP."""
    runner = web.AppRunner(make_app(root), access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    base = f"http://127.0.0.1:{runner.addresses[0][1]}"
    results = []
    try:
        async with aiohttp.ClientSession(base) as http:

            async def get(path: str, params: dict) -> tuple[dict | None, int]:
                async with http.get(path, params={k: str(v) for k, v in params.items()}) as resp:
                    body = await resp.read()
                    if resp.status != 200:
                        raise RuntimeError(f"{path} {params}: HTTP {resp.status}: {body[:300]!r}")
                    return (json.loads(body) if resp.content_type == "application/json" else None), len(body)

            async def page(name: str, *calls: tuple[str, dict]) -> list:
                """The page's calls fetched together (as the page does): warm-up, then `repeats` timings."""
                times = []
                for _ in range(repeats + 1):
                    t0 = time.perf_counter()
                    answers = await asyncio.gather(*(get(p, q) for p, q in calls))
                    times.append(1000 * (time.perf_counter() - t0))
                line = {"page": name, "median_ms": round(statistics.median(times[1:]), 1),
                        "max_ms": round(max(times[1:]), 1), "bytes": sum(b for _, b in answers),
                        "first_ms": round(times[0], 1)}  # fmt: skip
                print(json.dumps(line), flush=True)
                results.append(line)
                return [a for a, _ in answers]

            run = {"run": RUN}
            await page("runs", ("/api/runs", {}))
            for path in ("/api/run", "/api/curves", "/api/status_mix"):
                await page(f"run: {path}", (path, run))
            await page("run page (run + curves + status_mix)", ("/api/run", run), ("/api/curves", run),
                       ("/api/status_mix", run))  # fmt: skip
            [first] = await page("rollouts: first page", ("/api/rollouts", run))
            deep = {**run, "offset": max(0, first["total"] - 50)}
            [last] = await page("rollouts: deep page (offset total-50)", ("/api/rollouts", deep))
            await page("rollouts: status=failed", ("/api/rollouts", {**run, "status": "failed"}))
            text = {**run, "text": NEEDLE}
            [found] = await page(f"rollouts: text={NEEDLE}", ("/api/rollouts", text))
            assert found["rows"], "the text filter found nothing"
            await page(f"rollouts: text={NEEDLE}, page 5", ("/api/rollouts", {**text, "offset": 200}))
            # The page shows its rows first and asks for the total after (every row's text is read).
            [count] = await page(
                f"rollouts: text={NEEDLE}, total (after the page)", ("/api/rollouts_count", text)
            )
            assert count["total"] > 0
            await page("rollouts: tool_failed=1", ("/api/rollouts", {**run, "tool_failed": 1}))
            window = {**run, "step_min": steps // 2, "step_max": steps // 2 + max(1, steps // 10),
                      "reward_min": 1.0, "reward_max": 1.5}  # fmt: skip
            await page("rollouts: step range + reward range", ("/api/rollouts", window))
            row = last["rows"][-1]
            key = {**run, "split": row["split"], "step": row["step"], "group": row["group_id"]}
            await page("rollout", ("/api/rollout", {**key, "sample": row["sample_index"]}))
            await page("group", ("/api/group", key))
            [occ] = await page("occurrences", ("/api/occurrences", {"row_id": row["row_id"]}))
            a, b = occ["occurrences"][0], occ["occurrences"][-1]
            await page("compare", ("/api/compare", {"row_id": row["row_id"], "a_run": RUN, "a_step": a["step"],
                                                    "b_run": RUN, "b_step": b["step"]}))  # fmt: skip
            await page("sql: canned reward_curve", ("/api/sql", {"canned": "reward_curve", "run": RUN}))
            free = ("SELECT name, count(*) AS calls, count(*) FILTER (WHERE failed) AS failed "
                    "FROM tool_calls GROUP BY name ORDER BY name")  # fmt: skip
            await page("sql: free query (tool failures by name)", ("/api/sql", {"q": free}))
    finally:
        await runner.cleanup()
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=10_000)
    ap.add_argument("--rows-per-step", type=int, default=64, help="a multiple of the group size (8)")
    ap.add_argument("--store", type=Path, help="build (or reuse) the store here; kept")
    ap.add_argument("--keep", action="store_true", help="keep the temp store (its path is printed)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--budget-ms", type=float, default=300.0)
    args = ap.parse_args()
    if args.rows_per_step < G or args.rows_per_step % G:
        ap.error(f"--rows-per-step: a positive multiple of {G}, got {args.rows_per_step}")
    machine = {"cpus": os.cpu_count(), "python": platform.python_version(), "duckdb": duckdb.__version__,
               "pyarrow": pa.__version__, "aiohttp": aiohttp.__version__, "platform": platform.platform()}  # fmt: skip
    print(json.dumps({"machine": machine}), flush=True)
    root = args.store.resolve() if args.store else Path(tempfile.mkdtemp(prefix="grpoflow-explorer-"))
    try:
        root.mkdir(parents=True, exist_ok=True)
        t0 = time.perf_counter()
        if holds_run(root, args.steps, args.rows_per_step):
            fig = {"reused": True}
        elif any(root.iterdir()):
            sys.exit(f"--store {root}: not empty and not a store of this run at this size; pick an empty dir")
        else:
            fig = {"reused": False, **build(root, args.steps, args.rows_per_step)}
        fig |= {"seconds": round(time.perf_counter() - t0, 1), "root": str(root)}
        print(
            json.dumps({"build": {"steps": args.steps, "rows_per_step": args.rows_per_step, **fig}}),
            flush=True,
        )
        print(json.dumps({"store": store_facts(root)}), flush=True)
        results = asyncio.run(bench(root, args.steps, args.repeats))
        over = [r["page"] for r in results if r["median_ms"] > args.budget_ms]
        print(json.dumps({"budget_ms": args.budget_ms, "over_budget": over}))
    finally:
        if args.store is None and not args.keep:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()

"""Two runs compared row by row: did a rerun reproduce, and where did it first part?

`grpoflow compare RUN_A RUN_B` (and benchmarks/reproducibility.py, which trains the two runs) prints,
per item, "identical" or the FIRST difference with where to find it (table, step, split, group_id,
sample_index, column, value A vs value B): 1. rollouts (completion_ids, logprobs bit for bit, masks,
policy versions, prompt_ids, finish_reason, truncated; how many rows are identical), 2. rewards (value,
status per reward function), 3. rollouts' reward, reward_valid, advantage, trained, drop_reason,
4. steps (every numeric column but times and machine-dependent ones; the max abs difference of each
column that differs), 5. the final checkpoints' weights (max abs difference, the worst tensor, bitwise
equality), 6. what the runs' metadata says they ran on (seed, machine, threads, library versions:
tasks/rollouts/reproducible.py), any difference named. `report` returns the summary as a dict.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from grpoflow.storage.sql import query

ROLLOUT_KEY = ("split", "step", "group_id", "sample_index")
ROLLOUT_COLUMNS = (
    "completion_ids",
    "logprobs",
    "completion_mask",
    "policy_version",
    "policy_version_end",
    "prompt_ids",
    "finish_reason",
    "truncated",
)
ADVANTAGE_COLUMNS = ("reward", "reward_valid", "advantage", "trained", "drop_reason")
REWARD_COLUMNS = ("value", "status")
# Steps columns that measure the machine, not the run.
MACHINE_COLUMNS = {
    "run_id",
    "step",
    "created_at",
    "gen/servers_up",
    "server_restarts",
    "prefect_overhead_frac",
}


def same(x: Any, y: Any) -> bool:
    """Exact equality, NaN equal to NaN, lists element by element."""
    if isinstance(x, float) and isinstance(y, float) and math.isnan(x) and math.isnan(y):
        return True
    if isinstance(x, list) and isinstance(y, list):
        return len(x) == len(y) and all(same(a, b) for a, b in zip(x, y, strict=True))
    return x == y


def show(column: str, x: Any, y: Any) -> str:
    """`column: A vs B`; for lists the first differing element and both lengths."""
    if isinstance(x, list) and isinstance(y, list):
        i = next((i for i, (a, b) in enumerate(zip(x, y, strict=False)) if not same(a, b)), None)
        if i is None:
            return f"{column}: length {len(x)} vs {len(y)}"
        return f"{column}[{i}]: {x[i]!r} vs {y[i]!r} (lengths {len(x)} vs {len(y)})"
    return f"{column}: {x!r} vs {y!r}"


def keyed_rows(root: Path, table: str, run: str, key: tuple[str, ...], columns: tuple[str, ...]) -> dict:
    """{key tuple: row dict of `columns`} of one run's rows of `table`."""
    sql = f"SELECT {', '.join(key + columns)} FROM {table} WHERE run_id = $run"
    cols, rows = query(root, sql, {"run": run})
    return {r[: len(key)]: dict(zip(cols[len(key) :], r[len(key) :], strict=True)) for r in rows}


def compare_rows(
    root: Path, run_a: str, run_b: str, table: str, key: tuple[str, ...], columns: tuple[str, ...]
) -> dict:
    """Row by row over the union of both runs' keys (earliest step first): how many rows are equal in
    every one of `columns`, and the first difference (a line naming table, key, the first column that
    differs with both values, and the row's other differing columns) or None."""
    a, b = (keyed_rows(root, table, r, key, columns) for r in (run_a, run_b))
    order = sorted(set(a) | set(b), key=lambda k: (k[key.index("step")], k))
    first, equal = None, 0
    for k in order:
        where = f"{table} " + " ".join(f"{n}={v}" for n, v in zip(key, k, strict=True))
        if k not in a or k not in b:
            first = first or f"{where}: only in {run_a if k in a else run_b}"
            continue
        diff = [c for c in columns if not same(a[k][c], b[k][c])]
        if not diff:
            equal += 1
        elif first is None:
            also = f" (also differ: {', '.join(diff[1:])})" if diff[1:] else ""
            first = f"{where} {show(diff[0], a[k][diff[0]], b[k][diff[0]])}{also}"
    return {"equal": equal, "total": len(order), "first": first}


def compare_rollouts(root: Path, run_a: str, run_b: str) -> dict:
    """1. What was generated: tokens, logprobs (float32, exact), masks, versions, finish."""
    out = compare_rows(root, run_a, run_b, "rollouts", ROLLOUT_KEY, ROLLOUT_COLUMNS)
    tokens = compare_rows(root, run_a, run_b, "rollouts", ROLLOUT_KEY, ("completion_ids",))
    return out | {"same_completion_ids": tokens["equal"]}


def compare_rewards(root: Path, run_a: str, run_b: str) -> dict:
    """2. Each reward function's cell per completion: value and status."""
    return compare_rows(root, run_a, run_b, "rewards", (*ROLLOUT_KEY, "reward_name"), REWARD_COLUMNS)


def compare_advantages(root: Path, run_a: str, run_b: str) -> dict:
    """3. The rollouts' combined reward, validity, advantage and whether they were trained on."""
    return compare_rows(root, run_a, run_b, "rollouts", ROLLOUT_KEY, ADVANTAGE_COLUMNS)


def machine_dependent(column: str) -> bool:
    return column in MACHINE_COLUMNS or column.endswith("_s") or "seconds" in column


def compare_steps(root: Path, run_a: str, run_b: str) -> dict:
    """4. The steps table's numeric columns (times and machine-dependent ones left out): the first
    (step, column) that differs, and the max abs difference of every column that differs."""
    runs = {}
    for run in (run_a, run_b):
        cols, rows = query(root, "SELECT * FROM steps WHERE run_id = $run ORDER BY step", {"run": run})
        runs[run] = {r[cols.index("step")]: dict(zip(cols, r, strict=True)) for r in rows}
    a, b = runs[run_a], runs[run_b]

    def numeric(v: Any) -> bool:
        return isinstance(v, int | float)

    columns = sorted(
        {
            c
            for rows in (a, b)
            for row in rows.values()
            for c, v in row.items()
            if numeric(v) and not machine_dependent(c)
        }
    )
    first, max_diff = None, {}
    for step in sorted(set(a) | set(b)):
        if step not in a or step not in b:
            first = first or f"steps step={step}: only in {run_a if step in a else run_b}"
            continue
        for c in columns:
            x, y = a[step].get(c), b[step].get(c)
            if same(x, y):
                continue
            d = abs(x - y) if numeric(x) and numeric(y) else math.inf
            max_diff[c] = max(max_diff.get(c, 0.0), d if not math.isnan(d) else math.inf)
            first = first or f"steps step={step} {show(c, x, y)}"
    return {"columns": len(columns), "steps": len(set(a) | set(b)), "first": first, "max_abs_diff": max_diff}


def checkpoint_tensors(root: Path, run: str) -> tuple[int, dict]:
    """(step, {file/tensor name: tensor}) of a run's latest checkpoint: its `model/` safetensors (a
    LoRA run's `adapter/`)."""
    from safetensors.torch import load_file

    from grpoflow.storage.checkpoints import CheckpointStore

    path, step = CheckpointStore(root).at(run)
    tensors = {}
    for f in sorted(path.rglob("*.safetensors")):
        rel = f.relative_to(path)
        tensors |= {f"{rel}:{name}": t for name, t in load_file(f).items()}
    return step, tensors


def raw_bytes(t):
    """A tensor's bytes (so -0.0 differs from 0.0 and NaN payloads count)."""
    import torch

    return t.contiguous().reshape(-1).view(torch.uint8)


def compare_weights(root: Path, run_a: str, run_b: str) -> dict:
    """5. The final checkpoints: max abs difference per tensor, the worst tensor, bitwise equality."""
    step_a, a = checkpoint_tensors(root, run_a)
    step_b, b = checkpoint_tensors(root, run_b)
    diffs, bitwise = {}, step_a == step_b and set(a) == set(b)
    for name in sorted(set(a) | set(b)):
        x, y = a.get(name), b.get(name)
        if x is None or y is None or x.shape != y.shape or x.dtype != y.dtype:
            diffs[name], bitwise = math.inf, False
            continue
        diffs[name] = (x.double() - y.double()).abs().max().item() if x.numel() else 0.0
        bitwise = bitwise and raw_bytes(x).equal(raw_bytes(y))
    worst = max(diffs, key=diffs.get) if diffs else None
    return {
        "steps": (step_a, step_b),
        "tensors": len(diffs),
        "max_abs_diff": diffs.get(worst, 0.0),
        "worst": worst,
        "differing": sum(d > 0 for d in diffs.values()),
        "bitwise_equal": bitwise,
    }


def compare_environments(root: Path, run_a: str, run_b: str) -> list[str]:
    """6. What differs between the runs' reproducibility records (their run metadata)."""
    from grpoflow.storage.rollouts import RolloutStore
    from grpoflow.tasks.rollouts.reproducible import mismatches

    store = RolloutStore(root)
    a, b = ((store.read_run_meta(r) or {}).get("reproducibility") for r in (run_a, run_b))
    return mismatches(a, b)


def report(root: Path, run_a: str, run_b: str) -> dict:
    """Print every comparison; return the summary of the final JSON line."""

    def line(n: int, what: str, result: dict, counts: str) -> None:
        print(
            f"{n}. {what}: {counts}: "
            + (f"FIRST DIFFERENCE {result['first']}" if result["first"] else "identical"),
            flush=True,
        )

    ro = compare_rollouts(root, run_a, run_b)
    line(
        1,
        "rollouts",
        ro,
        f"{ro['equal']}/{ro['total']} rows identical, "
        f"{ro['same_completion_ids']}/{ro['total']} identical completions",
    )
    rw = compare_rewards(root, run_a, run_b)
    line(2, "rewards", rw, f"{rw['equal']}/{rw['total']} cells equal")
    adv = compare_advantages(root, run_a, run_b)
    line(3, "reward/advantage/trained", adv, f"{adv['equal']}/{adv['total']} rows equal")
    st = compare_steps(root, run_a, run_b)
    line(
        4,
        "steps",
        st,
        f"{st['columns']} numeric columns over {st['steps']} steps, {len(st['max_abs_diff'])} differ",
    )
    for c, d in sorted(st["max_abs_diff"].items(), key=lambda kv: -kv[1]):
        print(f"     max |A-B| {d:.6g}  {c}")
    w = compare_weights(root, run_a, run_b)
    print(
        f"5. weights: checkpoints at steps {w['steps'][0]} / {w['steps'][1]}, {w['tensors']} tensors, "
        f"{w['differing']} differ; max |A-B| {w['max_abs_diff']:.6g}"
        + (f" (worst: {w['worst']})" if w["differing"] else "")
        + f"; bitwise {'equal' if w['bitwise_equal'] else 'NOT equal'}",
        flush=True,
    )
    env = compare_environments(root, run_a, run_b)
    print("6. ran on: " + ("the same seed, machine, threads and versions" if not env else "; ".join(env)))
    return {
        "rollouts_identical": ro["equal"],
        "rollouts_total": ro["total"],
        "rewards_equal": rw["first"] is None,
        "advantages_equal": adv["first"] is None,
        "steps_equal": st["first"] is None,
        "weights_max_abs_diff": w["max_abs_diff"],
        "weights_bitwise_equal": w["bitwise_equal"],
        "environment_differences": env,
    }


def identical(summary: dict) -> bool:
    """Whether `report`'s summary says the runs are the same, bit for bit."""
    return (
        summary["rollouts_identical"] == summary["rollouts_total"]
        and summary["rewards_equal"]
        and summary["advantages_equal"]
        and summary["steps_equal"]
        and summary["weights_bitwise_equal"]
    )

"""The numbers behind `grpoflow report`'s figures and summary: parameterised SQL over the store's views
(the canned queries where they fit), one series per figure line, written as `report.json`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from grpoflow.storage.ids import validate_run_id
from grpoflow.storage.sql import CANNED, query

# steps column -> its name in step_time.png, in stacking order (columns a run lacks are skipped).
# Generation and scoring of later steps run while a step trains, so the stack can exceed wall time.
STEP_TIME_PARTS = {
    "gen_seconds": "generation",
    "score_seconds": "scoring",
    "train/seconds": "train",
    "sync_seconds": "push",
    "write_seconds": "write",
    "prefect_overhead_seconds": "Prefect",
    "checkpoint_seconds": "checkpoint",
}
STATUSES = ("invalid", "failed", "timeout")
NO_TOOL_CALLS = "no tool calls in this run"

# Per step and reward function: the share of its cells with each non-valid status.
_REWARD_STATUS_SQL = """
    SELECT reward_name, step, count(*) AS cells,
           avg(CASE WHEN status = 'invalid' THEN 1.0 ELSE 0.0 END) AS invalid,
           avg(CASE WHEN status = 'failed' THEN 1.0 ELSE 0.0 END) AS failed,
           avg(CASE WHEN status = 'timeout' THEN 1.0 ELSE 0.0 END) AS timeout
    FROM rewards WHERE run_id = $run AND split = 'train'
    GROUP BY reward_name, step ORDER BY reward_name, step"""

# Per step (every step with rollouts, zero-call steps included): tool calls and failed ones.
_TOOL_CALLS_SQL = """
    SELECT s.step, count(t.name) AS calls, count(*) FILTER (WHERE t.failed) AS failed
    FROM (SELECT DISTINCT step FROM rollouts WHERE run_id = $run AND split = 'train') s
    LEFT JOIN (SELECT * FROM tool_calls WHERE run_id = $run AND split = 'train') t ON t.step = s.step
    GROUP BY s.step ORDER BY s.step"""


def _series(rows: list[tuple], i: int) -> list[list]:
    """[[step, value], ...] from rows whose first column is the step."""
    return [[r[0], r[i]] for r in rows]


def report_data(root: str | Path, run_id: str) -> dict[str, Any]:
    """The numbers behind every figure, from parameterised SQL (the canned queries where they fit).

    Every series is [[step, value], ...]; values may be None (no valid completion at a step, a
    metric a step did not record)."""
    validate_run_id(run_id)
    run = {"run": run_id}
    _, curve = query(root, CANNED["reward_curve"], run)  # run_id, step, mean, std, valid_frac, n
    curve = [r[1:] for r in curve]
    _, held = query(root, CANNED["eval_curve"], run)  # the held-out split (run.eval_every), same columns
    held = [r[1:] for r in held]
    _, totals = query(root, CANNED["invalid_rate"], run)  # run_id, name, cells, rate, inv, fail, tout
    _, per_step = query(root, _REWARD_STATUS_SQL, run)
    _, lengths = query(root, CANNED["lengths"], run)  # run_id, step, mean, min, max, ...
    lengths = [r[1:] for r in lengths]
    _, tools = query(root, _TOOL_CALLS_SQL, run)
    cols, steps = query(root, "SELECT * FROM steps WHERE run_id = $run ORDER BY step", run)
    rows = [dict(zip(cols, r, strict=True)) for r in steps]

    def steps_series(col: str) -> list[list] | None:
        """A steps column as a series; None when the run never recorded it."""
        if not any(r.get(col) is not None for r in rows):
            return None
        return [[r["step"], r.get(col)] for r in rows]

    status: dict[str, dict[str, list[list]]] = {}
    for name, step, _, *rates in per_step:
        for s, rate in zip(STATUSES, rates, strict=True):
            status.setdefault(name, {k: [] for k in STATUSES})[s].append([step, rate])
    optional = {
        k: steps_series(k) for k in ["staleness_mean", "staleness_max", "wall_seconds", *STEP_TIME_PARTS]
    }
    return {
        "reward_curve": _series(curve, 1),
        "reward_std": _series(curve, 2),
        "valid_frac": _series(curve, 3),
        "eval_curve": _series(held, 1),
        "eval_valid_frac": _series(held, 3),
        "reward_status": status,
        "reward_status_totals": {
            r[1]: {"cells": r[2], "invalid": r[4] / r[2], "failed": r[5] / r[2], "timeout": r[6] / r[2]}
            for r in totals
        },
        "tool_calls": _series(tools, 1),
        "tool_failures": _series(tools, 2),
        "tool_success_rate": [[s, (n - f) / n if n else None] for s, n, f in tools],
        "staleness": {k: optional[k] for k in ("staleness_mean", "staleness_max") if optional[k]},
        "step_time": {k: optional[k] for k in STEP_TIME_PARTS if optional[k]},
        "wall_seconds": optional["wall_seconds"] or [],
        "mean_tokens": _series(lengths, 1),
        "min_tokens": _series(lengths, 2),
        "max_tokens": _series(lengths, 3),
    }

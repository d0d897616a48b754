"""The rollout explorer's rollout reads: a page of a run's rollouts under a filter, one completion, one
group, and where a dataset row was sampled.

Every function takes an open connection from `storage.explore.explorer_connection`, as the run pages
do; values come back cleaned the same way (storage/explore.py). Filters are bound parameters, never
SQL text.
"""

from __future__ import annotations

import json
import re
from typing import Any

import duckdb

from grpoflow.storage.explore import NotFound, _clean, _dicts

PAGE_MAX = 200  # rollouts per page at most
PREVIEW = 200  # characters of a prompt / completion in a table row

_ROW_COLUMNS = f"""split, step, group_id, sample_index, row_id, reward, reward_valid, advantage, trained,
    drop_reason, truncated, num_turns, len(tool_calls) AS tool_calls,
    len(list_filter(tool_calls, lambda t: t.failed)) AS tool_failures, server, policy_version, staleness,
    completion_tokens, left(prompt, {PREVIEW}) AS prompt_preview,
    left(completion, {PREVIEW}) AS completion_preview"""


def rollout_page(
    con: duckdb.DuckDBPyConnection, run_id: str, filters: dict[str, Any], offset: int = 0, limit: int = 50
) -> dict:
    """One page of a run's rollouts matching `filters` (see `_where`), in (step, group, sample) order,
    with their reward cells; `more`: whether a next page exists. `total` is the count of every match,
    except under a text search, where counting means reading every row's text (~0.5 s on 640,000
    rows): then it is None and `rollout_count` answers it in a request of its own."""
    limit = max(1, min(int(limit), PAGE_MAX))
    offset = max(0, int(offset))
    where, params = _where(run_id, filters)
    keys = _page_keys(con, where, params, offset, limit + 1, windowed=bool(filters.get("text")))
    more, keys = len(keys) > limit, keys[:limit]
    rows = _rows_at(con, run_id, params["split"], keys)
    _attach_cells(con, run_id, rows, with_reason=False)
    total = None if filters.get("text") else rollout_count(con, run_id, filters)
    return {"total": total, "more": more, "offset": offset, "limit": limit, "rows": rows}


def rollout_count(con: duckdb.DuckDBPyConnection, run_id: str, filters: dict[str, Any]) -> int:
    where, params = _where(run_id, filters)
    return con.execute(f"SELECT count(*) FROM rollouts r WHERE {where}", params).fetchall()[0][0]


def _page_keys(
    con: duckdb.DuckDBPyConnection,
    where: str,
    params: dict,
    offset: int,
    n: int,
    windowed: bool,
    width: int = 256,
) -> list[tuple]:
    """The (step, group_id, sample_index) keys of matches offset..offset+n, in order. Keys only: a
    deep page then sorts three narrow columns, not every row's text. A text search walks the steps in
    doubling windows and stops once it holds enough matches, so its first pages read only the
    first steps' text (the store's row groups are in step order, and DuckDB skips the others)."""
    order = "ORDER BY step, group_id, sample_index"
    base = f"SELECT step, group_id, sample_index FROM rollouts r WHERE {where}"
    if not windowed:
        return con.execute(f"{base} {order} LIMIT {n} OFFSET {offset}", params).fetchall()
    [(lo, hi)] = con.execute(
        "SELECT min(step), max(step) FROM rollouts r WHERE r.run_id = $run AND r.split = $split",
        {"run": params["run"], "split": params["split"]},
    ).fetchall()
    if lo is None:
        return []
    lo, hi = max(lo, params.get("step_min", lo)), min(hi, params.get("step_max", hi))
    keys: list[tuple] = []
    while lo <= hi and len(keys) < offset + n:
        keys += con.execute(
            f"{base} AND r.step BETWEEN {lo} AND {min(hi, lo + width - 1)} {order} LIMIT {offset + n - len(keys)}",
            params,
        ).fetchall()
        lo, width = lo + width, width * 2
    return keys[offset : offset + n]


def _rows_at(con: duckdb.DuckDBPyConnection, run_id: str, split: str, keys: list[tuple]) -> list[dict]:
    """The table rows of these rollouts, in the order of `keys`."""
    if not keys:
        return []
    found = _dicts(
        con,
        f"""
        SELECT {_ROW_COLUMNS} FROM rollouts r
        WHERE r.run_id = $run AND r.split = $split AND r.step BETWEEN $lo AND $hi
          AND list_contains($keys, r.step::VARCHAR || '/' || r.sample_index::VARCHAR || '/' || r.group_id)""",
        {
            "run": run_id,
            "split": split,
            "lo": min(k[0] for k in keys),
            "hi": max(k[0] for k in keys),
            "keys": [f"{st}/{i}/{g}" for st, g, i in keys],
        },
    )
    at = {(r["step"], r["group_id"], r["sample_index"]): r for r in found}
    return [at[k] for k in keys]


def _where(run_id: str, f: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """The WHERE clause of a rollout filter: every value is a bound parameter, never SQL text."""
    parts = ["r.run_id = $run", "r.split = $split"]
    params: dict[str, Any] = {"run": run_id, "split": f.get("split") or "train"}
    for key, cond in (
        ("step_min", "r.step >= $step_min"),
        ("step_max", "r.step <= $step_max"),
        ("reward_min", "r.reward >= $reward_min"),
        ("reward_max", "r.reward <= $reward_max"),
        ("server", "r.server = $server"),
        ("truncated", "r.truncated = $truncated"),
    ):
        if f.get(key) is not None:
            parts.append(cond)
            params[key] = f[key]
    if f.get("tool_failed"):
        parts.append("len(list_filter(r.tool_calls, lambda t: t.failed)) > 0")
    if f.get("text"):
        # Case-insensitive as a literal: RE2 with the text escaped beats lower() on both sides (which
        # copies every row's text) by ~30%.
        parts.append("(regexp_matches(r.completion, $text) OR regexp_matches(r.prompt, $text))")
        params["text"] = "(?i)" + re.escape(str(f["text"]))
    if f.get("status") or f.get("reward_name"):
        cell = [
            "w.run_id = r.run_id",
            "w.split = r.split",
            "w.step = r.step",
            "w.group_id = r.group_id",
            "w.sample_index = r.sample_index",
        ]
        if f.get("status"):
            cell.append("w.status = $status")
            params["status"] = f["status"]
        if f.get("reward_name"):
            cell.append("w.reward_name = $reward_name")
            params["reward_name"] = f["reward_name"]
        parts.append(f"EXISTS (SELECT 1 FROM rewards w WHERE {' AND '.join(cell)})")
    return " AND ".join(parts), params


def _attach_cells(con: duckdb.DuckDBPyConnection, run_id: str, rows: list[dict], with_reason: bool) -> None:
    """Each row's reward cells as {name: {status, value[, reason]}}, read for exactly these rows."""
    for r in rows:
        r["cells"] = {}
    if not rows:
        return
    keys = {(r["split"], r["step"], r["group_id"], r["sample_index"]): r for r in rows}
    lo, hi = min(r["step"] for r in rows), max(r["step"] for r in rows)
    reason = ", reason" if with_reason else ""
    cells = con.execute(
        f"""
        SELECT split, step, group_id, sample_index, reward_name, status, value{reason} FROM rewards
        WHERE run_id = $run AND step BETWEEN $lo AND $hi AND group_id IN (SELECT unnest($groups))
        ORDER BY reward_name""",
        {"run": run_id, "lo": lo, "hi": hi, "groups": sorted({r["group_id"] for r in rows})},
    ).fetchall()
    for split, step, group, sample, name, status, value, *rest in cells:
        row = keys.get((split, step, group, sample))
        if row is not None:
            row["cells"][name] = {"status": status, "value": _clean(value)}
            if with_reason:
                row["cells"][name]["reason"] = rest[0]


def rollout(
    con: duckdb.DuckDBPyConnection, run_id: str, split: str, step: int, group: str, sample: int
) -> dict:
    """One completion with everything the store holds about it, its reward cells, and the cells later
    rescores gave it (`rescored_cells`)."""
    key = {"run": run_id, "split": split, "step": step, "group": group, "sample": sample}
    where = (
        "run_id = $run AND split = $split AND step = $step AND group_id = $group AND sample_index = $sample"
    )
    found = _dicts(con, f"SELECT * EXCLUDE (prompt_ids) FROM rollouts WHERE {where}", key)
    if not found:
        raise NotFound(f"no rollout {group!r} sample {sample} at step {step} ({split}) in run {run_id!r}")
    r = found[0]
    r["cells"] = _dicts(
        con,
        f"""
        SELECT reward_name, weight, value, status, reason, duration_s, imputed, imputed_value, extra
        FROM rewards WHERE {where} ORDER BY reward_name""",
        key,
    )
    r["rescored_cells"] = _dicts(
        con,
        f"""
        SELECT rescore, version, reward_name, weight, value, status, reason, duration_s, imputed, imputed_value, extra
        FROM rescores WHERE {where} ORDER BY version, reward_name""",
        key,
    )
    for c in r["cells"] + r["rescored_cells"]:
        c["extra"] = json.loads(c["extra"]) if c["extra"] else None
    return r


def group(con: duckdb.DuckDBPyConnection, run_id: str, split: str, step: int, group_id: str) -> dict:
    """The G completions of one prompt at one step, highest advantage first."""
    params = {"run": run_id, "split": split, "step": step, "group": group_id}
    rows = _dicts(
        con,
        f"""
        SELECT {_ROW_COLUMNS}, prompt_index, prompt, completion FROM rollouts
        WHERE run_id = $run AND split = $split AND step = $step AND group_id = $group
        ORDER BY advantage DESC, sample_index""",
        params,
    )
    if not rows:
        raise NotFound(f"no group {group_id!r} at step {step} ({split}) in run {run_id!r}")
    _attach_cells(con, run_id, rows, with_reason=True)
    first = rows[0]
    return {
        "run_id": run_id,
        "split": split,
        "step": step,
        "group_id": group_id,
        "row_id": first["row_id"],
        "prompt_index": first["prompt_index"],
        "prompt": first["prompt"],
        "completions": rows,
    }


def occurrences(con: duckdb.DuckDBPyConnection, row_id: str, split: str = "train") -> list[dict]:
    """Every (run, step) where the dataset row `row_id` was sampled, with the group's mean reward."""
    return _dicts(
        con,
        """
        SELECT run_id, split, step, group_id, avg(reward) FILTER (WHERE reward_valid) AS reward_mean,
               count(*) AS completions
        FROM rollouts WHERE row_id = $row AND split = $split
        GROUP BY run_id, split, step, group_id ORDER BY run_id, step, group_id""",
        {"row": row_id, "split": split},
    )


def group_of_row(
    con: duckdb.DuckDBPyConnection, run_id: str, step: int, row_id: str, split: str = "train"
) -> dict:
    """The group that sampled `row_id` at `step` of `run_id` (the first, if a step sampled it twice)."""
    found = con.execute(
        "SELECT min(group_id) FROM rollouts WHERE run_id = $run AND step = $step AND row_id = $row AND split = $split",
        {"run": run_id, "step": step, "row": row_id, "split": split},
    ).fetchall()
    if not found or found[0][0] is None:
        raise NotFound(f"prompt row {row_id!r} was not sampled at step {step} ({split}) of run {run_id!r}")
    return group(con, run_id, split, step, found[0][0])

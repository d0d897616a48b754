"""The rollout explorer's reads: its connection, and the run pages' figures (the runs overview, a run's
header, curves, reward status mix) as plain dicts, from the store's views. The rollout pages' reads
are storage/explore_rollouts.py.

Every function takes an open connection from `explorer_connection(root, runs)`: the confined,
read-only DuckDB views of storage/sql.py, held under the store's read lock for as long as the page's
queries run. Nothing here reads the Parquet layout itself, and nothing writes. Values that JSON
cannot hold (NaN, infinities) come back as None; timestamps as ISO strings.

Long runs are bucketed, never truncated: a curve of 10,000 steps is the mean of each run of
`bucket` consecutive steps (at most `MAX_POINTS` points), so a page costs the same at any length.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime
from pathlib import Path
from typing import Any

import duckdb

from grpoflow.storage.layout import reading
from grpoflow.storage.sql import connect

MAX_POINTS = 600  # points per curve on a run page
TREND_POINTS = 40  # points of a run's sparkline on the runs page
STATUSES = ("valid", "invalid", "failed", "timeout")

# The run page's panels: title -> which `steps` columns it draws (the first panel that matches wins).
_STEP_TIME = (
    "wall_seconds",
    "gen_seconds",
    "score_seconds",
    "train/seconds",
    "sync_seconds",
    "write_seconds",
    "checkpoint_seconds",
    "eval_seconds",
    "wait_seconds",
    "prefect_overhead_seconds",
)
PANELS: list[tuple[str, re.Pattern]] = [
    ("Reward", re.compile(r"^reward/(mean|std|valid_frac|[^/]+/mean)$")),
    ("Held-out eval", re.compile(r"^eval/(reward/(mean|valid_frac|[^/]+/mean)|pass_rate)$")),
    ("Loss", re.compile(r"^train/loss$")),
    ("KL", re.compile(r"^train/\w*kl$")),
    ("Clipping", re.compile(r"^train/(clip_frac\w*|is_capped_frac|is_masked_frac)$")),
    ("Staleness", re.compile(r"^staleness_(mean|max)$")),
    ("Step time (s)", re.compile("^(" + "|".join(re.escape(c) for c in _STEP_TIME) + ")$")),
]


class NotFound(LookupError):
    """The run, rollout or group asked for is not in the store (the message names it)."""


@contextmanager
def explorer_connection(
    root: str | Path, runs: list[str] | None = None
) -> Iterator[duckdb.DuckDBPyConnection]:
    """The store's confined views (of `runs` only, when given), under the read lock until closed."""
    with reading(Path(root).resolve()):
        con = connect(root, runs)
        try:
            yield con
        finally:
            con.close()


def _clean(v: Any) -> Any:
    if isinstance(v, float) and not math.isfinite(v):
        return None
    if isinstance(v, datetime):
        return v.isoformat()
    if isinstance(v, list):
        return [_clean(x) for x in v]
    if isinstance(v, dict):
        return {k: _clean(x) for k, x in v.items()}
    return v


def _dicts(con: duckdb.DuckDBPyConnection, sql: str, params: dict[str, Any] | None = None) -> list[dict]:
    rel = con.execute(sql, params or {})
    cols = [d[0] for d in rel.description]
    return [{c: _clean(v) for c, v in zip(cols, row, strict=True)} for row in rel.fetchall()]


def _ident(name: str) -> str:
    return '"' + name.replace('"', '""') + '"'


# -- runs ------------------------------------------------------------------------------------------


def _lineage_of(decisions: dict[str, list[dict]]) -> dict[str, str]:
    """Run id -> the lineage it belongs to: the lineage's own run and each candidate it decided on."""
    lineage_of: dict[str, str] = {}
    for lineage, rows in decisions.items():
        lineage_of.setdefault(lineage, lineage)
        for d in rows:
            lineage_of.setdefault(d["candidate_run"], lineage)
    return lineage_of


def runs_overview(con: duckdb.DuckDBPyConnection, metas: dict[str, dict]) -> list[dict]:
    """Every run of `metas` (run id -> runs/<run>.json) with its progress, status, sparkline and the
    promotions of the lineage it belongs to."""
    from grpoflow.storage.sql import run_status

    progress = {
        r["run_id"]: r
        for r in _dicts(
            con,
            """
        SELECT run_id, count(DISTINCT step) AS steps, max(step) AS last_step, count(*) AS completions
        FROM rollouts GROUP BY run_id""",
        )
    }
    trend: dict[str, list] = {}
    for r in _dicts(
        con,
        f"""
        WITH b AS (SELECT run_id, greatest(1, ceil((max(step) + 1) / {TREND_POINTS}))::BIGINT AS w
                   FROM rollouts WHERE split = 'train' GROUP BY run_id)
        SELECT r.run_id, min(r.step) AS step, avg(r.reward) FILTER (WHERE r.reward_valid) AS reward
        FROM rollouts r JOIN b USING (run_id) WHERE r.split = 'train'
        GROUP BY r.run_id, r.step // b.w ORDER BY r.run_id, step""",
    ):
        trend.setdefault(r["run_id"], []).append([r["step"], r["reward"]])
    last = {
        r["run_id"]: r["reward"]
        for r in _dicts(
            con,
            """
        SELECT run_id, avg(reward) FILTER (WHERE reward_valid) AS reward FROM rollouts
        WHERE (run_id, step, split) IN (SELECT run_id, max(step), max(split) FROM rollouts GROUP BY run_id)
        GROUP BY run_id""",
        )
    }
    decisions = _promotions(con)
    lineage_of = _lineage_of(decisions)
    out = []
    for run_id, meta in sorted(metas.items()):
        p = progress.get(run_id, {})
        lineage = lineage_of.get(run_id)
        out.append(
            {
                "run_id": run_id,
                "status": run_status(meta),
                "steps": p.get("steps", 0),
                "last_step": p.get("last_step"),
                "completions": p.get("completions", 0),
                "last_reward": last.get(run_id),
                "base_model": meta.get("base_model"),
                "created_at": meta.get("created_at"),
                "updated_at": meta.get("updated_at"),
                "lineage": lineage,
                "promotions": decisions.get(lineage, []) if lineage else [],
                "replay_of": meta.get("replay_of"),
                "trend": trend.get(run_id, []),
            }
        )
    return out


def _promotions(con: duckdb.DuckDBPyConnection) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {}
    for r in _dicts(
        con,
        """
        SELECT lineage, decision_id, decision, reason, candidate_run, candidate_step, created_at
        FROM promotions ORDER BY lineage, decision_id""",
    ):
        out.setdefault(r.pop("lineage"), []).append(r)
    return out


def run_detail(con: duckdb.DuckDBPyConnection, run_id: str, meta: dict) -> dict:
    """One run's header: status, what its rows hold (splits, reward names, servers), its promotions."""
    from grpoflow.storage.sql import run_status

    [facts] = _dicts(
        con,
        """
        SELECT min(step) AS first_step, max(step) AS last_step, count(DISTINCT step) AS steps,
               list(DISTINCT split ORDER BY split) AS splits,
               list(DISTINCT server ORDER BY server) FILTER (WHERE server IS NOT NULL) AS servers,
               bool_or(len(tool_calls) > 0) AS has_tool_calls
        FROM rollouts WHERE run_id = $run""",
        {"run": run_id},
    )
    names = [
        r["reward_name"]
        for r in _dicts(
            con,
            """
        SELECT DISTINCT reward_name FROM rewards WHERE run_id = $run ORDER BY reward_name""",
            {"run": run_id},
        )
    ]
    return {
        "run_id": run_id,
        "status": run_status(meta),
        "base_model": meta.get("base_model"),
        "created_at": meta.get("created_at"),
        "updated_at": meta.get("updated_at"),
        "flow_runs": meta.get("flow_runs", []),
        "config": meta.get("config"),
        **facts,
        "splits": facts["splits"] or [],
        "servers": facts["servers"] or [],
        "has_tool_calls": bool(facts["has_tool_calls"]),
        "has_eval": "eval" in (facts["splits"] or []),
        "reward_names": names,
        "promotions": _promotions(con).get(run_id, []),
        "replay_of": meta.get("replay_of"),
        "replay_where": meta.get("replay_where"),
        "rescores": rescores(con, run_id),
    }


def rescores(con: duckdb.DuckDBPyConnection, run_id: str) -> list[dict]:
    """Each rescore of the run (grpoflow rescore) per reward: its cells by status and the mean of its
    valid values, beside the mean of the run's own cells of a reward of that name (None without one)."""
    return _dicts(
        con,
        """
        WITH own AS (SELECT reward_name, avg(value) FILTER (WHERE status = 'valid') AS own_mean
                     FROM rewards WHERE run_id = $run GROUP BY reward_name)
        SELECT s.rescore, s.version, s.reward_name, min(s.created_at) AS created_at, count(*) AS cells,
               count(*) FILTER (WHERE s.status = 'valid') AS valid,
               count(*) FILTER (WHERE s.status <> 'valid') AS not_valid,
               avg(s.value) FILTER (WHERE s.status = 'valid') AS mean, any_value(o.own_mean) AS own_mean
        FROM rescores s LEFT JOIN own o USING (reward_name) WHERE s.run_id = $run
        GROUP BY s.rescore, s.version, s.reward_name ORDER BY s.version, s.reward_name""",
        {"run": run_id},
    )


def _bucket(con: duckdb.DuckDBPyConnection, table: str, run_id: str, points: int = MAX_POINTS) -> int:
    [(hi,)] = con.execute(f"SELECT max(step) FROM {table} WHERE run_id = $run", {"run": run_id}).fetchall()
    return max(1, math.ceil(((hi or 0) + 1) / points))


def curves(con: duckdb.DuckDBPyConnection, run_id: str) -> dict:
    """The run page's curves: every numeric `steps` column a panel draws, bucketed to MAX_POINTS."""
    numeric = ("DOUBLE", "FLOAT", "BIGINT", "INTEGER", "HUGEINT", "SMALLINT", "TINYINT", "DECIMAL")
    cols = [
        name
        for name, kind, *_ in con.execute("DESCRIBE steps").fetchall()
        if name not in ("step", "policy_version") and str(kind).startswith(numeric)
    ]
    panels: dict[str, list[str]] = {}
    for c in cols:
        title = next((t for t, pat in PANELS if pat.search(c)), None)
        if title:
            panels.setdefault(title, []).append(c)
    wanted = [c for names in panels.values() for c in names]
    w = _bucket(con, "steps", run_id)
    series: dict[str, list] = {c: [] for c in wanted}
    if wanted:
        sel = ", ".join(f"avg({_ident(c)}) AS {_ident(c)}" for c in wanted)
        rel = con.execute(
            f"SELECT min(step) AS step, {sel} FROM steps WHERE run_id = $run GROUP BY step // {w} ORDER BY 1",
            {"run": run_id},
        )
        for row in rel.fetchall():
            for c, v in zip(wanted, row[1:], strict=True):
                if v is not None and math.isfinite(v):
                    series[c].append([row[0], v])
    order = [t for t, _ in PANELS]
    return {
        "bucket": w,
        "series": {c: s for c, s in series.items() if s},
        "panels": [
            {"title": t, "names": [c for c in panels[t] if series[c]]}
            for t in order
            if any(series[c] for c in panels.get(t, []))
        ],
    }


def status_mix(con: duckdb.DuckDBPyConnection, run_id: str, split: str = "train") -> dict:
    """Per reward function and (bucketed) step, how many cells had each status."""
    w = _bucket(con, "rewards", run_id)
    counts = ", ".join(f"count(*) FILTER (WHERE status = '{s}') AS {s}" for s in STATUSES)
    rows = _dicts(
        con,
        f"""
        SELECT min(step) AS step, reward_name, {counts} FROM rewards
        WHERE run_id = $run AND split = $split
        GROUP BY reward_name, step // {w} ORDER BY reward_name, step""",
        {"run": run_id, "split": split},
    )
    return {"bucket": w, "reward_names": sorted({r["reward_name"] for r in rows}), "rows": rows}

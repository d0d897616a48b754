"""DuckDB over the store: read-only views, canned queries, result formatting.

Views: `rollouts`, `rewards`, `steps` (unioned by name: metric columns differ between runs, columns
were added between versions), `tool_calls` (one row per tool call), `promotions` (one row per
promotion decision of a lineage, storage/promotions.py) and `rescores` (the cells of later rescores of
a run's completions, storage/rescores.py). Each view reads an explicit list of the
published files that storage/layout.py says are visible (a step file, or a compacted range that
replaces step files; never both for one step, never the hidden temp names of atomic writes), listed
and read under the store's read lock so that no compaction deletes a listed file meanwhile. A table
with no files yet is still a view with the right columns and zero rows.
"""

from __future__ import annotations

import csv
import io
import json
from pathlib import Path
from typing import Any

import duckdb
import pyarrow as pa

from grpoflow.storage.ids import validate_run_id
from grpoflow.storage.layout import reading, visible_parts
from grpoflow.storage.promotions import PROMOTIONS_SCHEMA
from grpoflow.storage.rescores import RESCORES_SCHEMA
from grpoflow.storage.tables import SCHEMAS

VIEWS: dict[str, pa.Schema] = {**SCHEMAS, "promotions": PROMOTIONS_SCHEMA, "rescores": RESCORES_SCHEMA}

# Read statements only: everything else (CREATE, COPY, INSERT, ATTACH, INSTALL/LOAD, SET, PRAGMA,
# CALL, EXPORT, ...) is refused before it runs.
_ALLOWED = {"SELECT", "EXPLAIN"}


class QueryError(ValueError):
    """A query that cannot run (bad SQL, an unknown table or column, a failed cast): DuckDB's message
    on one line, for a person who typed it."""


class ReadOnlyQueryError(QueryError):
    """A statement that could change state was refused."""


def _one_line(e: duckdb.Error) -> str:
    """DuckDB's message without the excerpt of the query it appends ('LINE 1: ...' over a caret line):
    the excerpt only lines up in a fixed-width block, so on one line it would point nowhere."""
    head = str(e).split("\nLINE ", 1)[0]
    return " ".join(line.strip() for line in head.splitlines() if line.strip())


def table_files(root: Path, table: str, runs: list[str] | None = None) -> list[str]:
    """The visible files of `table`, every run's or those of `runs` (call it under `reading(root)`).
    A lineage's promotions live under its name: `runs` names lineages there."""
    base = root / table
    if not base.is_dir():
        return []
    if runs is not None:
        dirs = [base / f"run_id={validate_run_id(r)}" for r in sorted(set(runs))]
        dirs = [d for d in dirs if d.is_dir()]
    else:
        dirs = sorted(d for d in base.iterdir() if d.is_dir() and not d.name.startswith("."))
    return [str(p.path) for d in dirs for p in visible_parts(d)]


def _sql_list(paths: list[str]) -> str:
    return "[" + ", ".join("'" + p.replace("'", "''") + "'" for p in paths) + "]"


def connect(root: str | Path, runs: list[str] | None = None) -> duckdb.DuckDBPyConnection:
    """An in-memory connection with the store's views, confined to the store: DuckDB's own external
    access settings let queries read files under the store root only (its table functions would
    otherwise read any file the process can: `read_text('/etc/passwd')`), extensions never load, and
    the configuration is locked so no statement can undo it.

    The views read the files visible now: hold `storage.layout.reading(root)` from this call until
    the last query on the connection is answered (`query` does), or a compaction may delete a file
    they list. `runs`: the views hold those runs' rows only (and those lineages' promotions), and
    list and open only their files: a page about one run need not read the whole store's metadata."""
    root = Path(root).resolve()  # symlinks resolved: the allowed directory is the real store
    con = duckdb.connect(":memory:")
    for table, schema in VIEWS.items():
        files = table_files(root, table, runs)
        # Every column of today's schema, also where every visible file predates it: nested fields
        # too (rollouts' tool_calls `node`), which DuckDB cannot name in a file that lacks them.
        con.register(f"_empty_{table}", pa.Table.from_pylist([], schema=schema))
        if files:
            # By name: steps' metric columns differ between runs (and within a compacted range), and
            # files written before a column existed (rewards' `imputed`, rollouts' `row_id`) must not
            # hide it (DuckDB takes the first file's schema otherwise).
            since = " UNION ALL BY NAME SELECT * FROM _empty_rollouts" if table == "rollouts" else ""
            con.execute(
                f"CREATE VIEW {table} AS SELECT * FROM read_parquet({_sql_list(files)}, "
                f"hive_partitioning = false, union_by_name = true){since}"
            )
        else:
            con.execute(f"CREATE VIEW {table} AS SELECT * FROM _empty_{table}")
    con.execute(
        """CREATE VIEW tool_calls AS
        SELECT run_id, split, step, group_id, sample_index, tc.turn AS turn, tc.name AS name,
               tc.arguments AS arguments, tc.result AS result, tc.failed AS failed,
               tc.error AS error, tc.duration_s AS duration_s, tc.node AS node
        FROM (SELECT run_id, split, step, group_id, sample_index, unnest(tool_calls) AS tc
              FROM rollouts)"""
    )
    confine(con, root)
    return con


def confine(con: duckdb.DuckDBPyConnection, root: Path) -> None:
    """Files under `root` only (DuckDB refuses other paths and symlinks that lead out), no extension
    installs or loads, then the configuration locked: SET/RESET can no longer change any of it."""
    con.execute("SET autoinstall_known_extensions = false")
    con.execute("SET autoload_known_extensions = false")
    con.execute("SET allowed_directories = $dirs", {"dirs": [f"{root}/"]})
    con.execute("SET enable_external_access = false")
    con.execute("SET lock_configuration = true")


def check_read_only(con: duckdb.DuckDBPyConnection, sql: str) -> None:
    try:
        statements = con.extract_statements(sql)
    except duckdb.Error as e:
        raise QueryError(f"cannot parse query: {_one_line(e)}") from None
    if not statements:
        raise QueryError("empty query")
    for st in statements:
        kind = st.type.name
        if kind not in _ALLOWED:
            raise ReadOnlyQueryError(
                f"refused {kind} statement: grpoflow sql is read-only (SELECT / WITH / EXPLAIN / "
                "DESCRIBE / SHOW / SUMMARIZE only)"
            )


def query(root: str | Path, sql: str, params: dict[str, Any] | None = None) -> tuple[list[str], list[tuple]]:
    """Run one read-only query; returns (column names, rows). A query DuckDB refuses or fails raises
    QueryError with its message (an interrupt stays an interrupt)."""

    def rows(rel: duckdb.DuckDBPyConnection) -> tuple[list[str], list[tuple]]:
        cols = [d[0] for d in rel.description] if rel.description else []
        return cols, rel.fetchall()  # DuckDB may raise while fetching, too

    return _read(root, sql, params, rows)


def query_arrow(root: str | Path, sql: str) -> pa.Table:
    """`query`, its result as an Arrow table: nested columns (messages, tool_calls) keep their types."""
    # a relation (con.sql), not a cursor: DuckDB 2 copies the rows once more for a cursor's Arrow output
    return _read(root, sql, None, lambda rel: rel.to_arrow_table(), relation=True)


def _read(
    root: str | Path, sql: str, params: dict[str, Any] | None, fetch: Any, relation: bool = False
) -> Any:
    with reading(Path(root).resolve()):
        con = connect(root)
        try:
            check_read_only(con, sql)
            used = {k: v for k, v in (params or {}).items() if f"${k}" in sql}
            try:
                if relation:
                    return fetch(con.sql(sql))
                return fetch(con.execute(sql, used) if used else con.execute(sql))
            except duckdb.InterruptException:
                raise
            except duckdb.Error as e:
                raise QueryError(_one_line(e)) from None
        finally:
            con.close()


_RUN = "($run IS NULL OR run_id = $run)"


def _curve(split: str) -> str:
    return f"""
        SELECT run_id, step,
               avg(reward) FILTER (WHERE reward_valid) AS reward_mean,
               stddev_pop(reward) FILTER (WHERE reward_valid) AS reward_std,
               avg(CASE WHEN reward_valid THEN 1.0 ELSE 0.0 END) AS valid_frac,
               count(*) AS completions
        FROM rollouts WHERE split = '{split}' AND {_RUN}
        GROUP BY run_id, step ORDER BY run_id, step"""


CANNED: dict[str, str] = {
    # Reward per step over valid completions only; invalid ones are counted, never scored 0.
    "reward_curve": _curve("train"),
    # The held-out split scored during training (run.eval_every) or by grpo-evaluate: the same figures.
    "eval_curve": _curve("eval"),
    "invalid_rate": f"""
        SELECT run_id, reward_name, count(*) AS cells,
               avg(CASE WHEN status <> 'valid' THEN 1.0 ELSE 0.0 END) AS invalid_rate,
               count(*) FILTER (WHERE status = 'invalid') AS invalid,
               count(*) FILTER (WHERE status = 'failed') AS failed,
               count(*) FILTER (WHERE status = 'timeout') AS timeout
        FROM rewards WHERE split = 'train' AND {_RUN}
        GROUP BY run_id, reward_name ORDER BY run_id, reward_name""",
    "tool_failures": f"""
        SELECT run_id, name AS tool, count(*) AS calls,
               count(*) FILTER (WHERE failed) AS failed,
               avg(CASE WHEN failed THEN 1.0 ELSE 0.0 END) AS failure_rate
        FROM tool_calls WHERE split = 'train' AND {_RUN}
        GROUP BY run_id, name ORDER BY run_id, name""",
    "lengths": f"""
        SELECT run_id, step, avg(completion_tokens) AS mean_tokens,
               min(completion_tokens) AS min_tokens, max(completion_tokens) AS max_tokens,
               quantile_cont(completion_tokens, 0.5) AS p50_tokens,
               avg(CASE WHEN truncated THEN 1.0 ELSE 0.0 END) AS truncated_rate
        FROM rollouts WHERE split = 'train' AND {_RUN}
        GROUP BY run_id, step ORDER BY run_id, step""",
    # Completions a rescore (grpoflow rescore) judged otherwise than the run did: its total (the weighted
    # sum of its valid cells; valid when all its cells are) against the run's own reward.
    "rescore_disagreements": f"""
        WITH new AS (
            SELECT run_id, step, group_id, sample_index, rescore, version,
                   bool_and(status = 'valid') AS new_valid,
                   sum(weight * value) FILTER (WHERE status = 'valid') AS new_total,
                   string_agg(reward_name || ': ' || status || coalesce(' (' || nullif(reason, '') || ')', ''), '; ')
                       FILTER (WHERE status <> 'valid') AS new_reason
            FROM rescores WHERE {_RUN}
            GROUP BY run_id, step, group_id, sample_index, rescore, version)
        SELECT n.run_id, n.rescore, n.version, n.step, n.group_id, n.sample_index,
               r.reward, r.reward_valid, CASE WHEN n.new_valid THEN n.new_total END AS new_reward,
               n.new_valid, n.new_reason, r.completion
        FROM new n JOIN rollouts r USING (run_id, step, group_id, sample_index)
        WHERE r.reward_valid IS DISTINCT FROM n.new_valid
           OR (n.new_valid AND r.reward_valid AND abs(r.reward - n.new_total) > 1e-9)
        ORDER BY n.run_id, n.version, n.step, n.group_id, n.sample_index""",
    # A lineage's promotion history (--run names the lineage): what was served after each decision.
    "promotions": """
        SELECT lineage, decision_id, created_at, decision, reason, metric,
               candidate_run, candidate_step, candidate_score,
               incumbent_run, incumbent_step, incumbent_score,
               serving_run, serving_step, server
        FROM promotions WHERE ($run IS NULL OR lineage = $run)
        ORDER BY lineage, decision_id""",
}


def run_canned(root: str | Path, name: str, run: str | None = None) -> tuple[list[str], list[tuple]]:
    if name not in CANNED:
        raise KeyError(f"unknown canned query {name!r}; choose from {sorted(CANNED)}")
    return query(root, CANNED[name], {"run": run})


def list_runs(root: str | Path) -> tuple[list[str], list[tuple]]:
    """Runs in the store with their progress and status (from runs/<run>.json), and the run a replay
    trained on (`replay_of`, flows/lineage/replay.py)."""
    from grpoflow.storage.rollouts import RolloutStore

    store = RolloutStore(root)
    _, rows = query(
        root,
        """SELECT run_id, count(DISTINCT step) AS steps, max(step) AS last_step, count(*) AS completions
           FROM rollouts GROUP BY run_id""",
    )
    by_run = {r[0]: r for r in rows}
    _, last = query(
        root,
        # The last step's training rows; a run of eval rows only (grpo-evaluate's): its eval rows.
        """SELECT run_id, avg(reward) FILTER (WHERE reward_valid) FROM rollouts
           WHERE (run_id, step, split) IN (SELECT run_id, max(step), max(split) FROM rollouts GROUP BY run_id)
           GROUP BY run_id""",
    )
    last_reward = dict(last)
    out = []
    for run_id in store.runs():
        meta = store.read_run_meta(run_id) or {}
        _, steps, last_step, completions = by_run.get(run_id, (run_id, 0, None, 0))
        row = (run_id, run_status(meta), steps, last_step, completions, last_reward.get(run_id))
        out.append((*row, meta.get("replay_of")))
    return ["run_id", "status", "steps", "last_step", "completions", "last_reward", "replay_of"], out


def run_status(meta: dict) -> str:
    """The recorded status, except that a `running` run whose owning process is gone (same host, no
    process with its pid and start time) is `interrupted`: it died without a word (SIGKILL, OOM)."""
    from grpoflow.storage.processes import is_alive

    status = meta.get("status", "unknown")
    if status == "running" and is_alive(meta.get("owner")) is False:
        return "interrupted"
    return status


def format_result(columns: list[str], rows: list[tuple], fmt: str = "table") -> str:
    if fmt == "json":
        return json.dumps([dict(zip(columns, r, strict=True)) for r in rows], default=str, indent=1)
    if fmt == "csv":
        buf = io.StringIO()
        # "\n" as DuckDB's and sqlite3's shells end lines: csv's default "\r\n" leaves a "\r" in
        # every value a shell script reads back (`n=$(grpoflow sql ... | tail -1)`).
        w = csv.writer(buf, lineterminator="\n")
        w.writerow(columns)
        w.writerows(rows)
        return buf.getvalue().rstrip("\n")
    from rich.console import Console
    from rich.table import Table

    t = Table(show_lines=False)
    for c in columns:
        t.add_column(c)
    for r in rows:
        t.add_row(*[_cell(v) for v in r])
    console = Console(file=io.StringIO(), width=200, record=True)
    console.print(t)
    return console.export_text().rstrip("\n") + f"\n({len(rows)} rows)"


def _cell(v: Any) -> str:
    if v is None:
        return "NULL"
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)

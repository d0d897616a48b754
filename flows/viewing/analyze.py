"""rollout-sql: run a SQL file, SQL text or a canned query against the store; publish a table artifact."""

from __future__ import annotations

from typing import Any

from prefect import flow
from prefect.artifacts import create_table_artifact

from grpoflow.storage.sql import CANNED, query
from grpoflow.tasks.config.allowlist import check_path


@flow(name="rollout-sql", log_prints=True)
def rollout_sql(
    root: str = "runs",
    canned: str | None = "reward_curve",
    sql: str | None = None,
    sql_file: str | None = None,
    run: str | None = None,
    max_rows: int = 500,
) -> dict[str, Any]:
    """Read-only SQL over rollouts/rewards/steps/tool_calls; the result becomes a Prefect table artifact.

    A worker-started run reads `root` and `sql_file` only inside the worker's allowed roots."""
    check_path(root, "root")
    if sql_file:
        sql = check_path(sql_file, "sql_file").read_text()
    if sql:
        cols, rows = query(root, sql)
        title = "custom query"
    elif canned:
        if canned not in CANNED:
            raise ValueError(f"canned: unknown query {canned!r}; choose from {sorted(CANNED)}")
        cols, rows = query(root, CANNED[canned], {"run": run})
        title = f"canned query {canned}"
    else:
        raise ValueError("give sql, sql_file or canned")
    table = [
        dict(zip(cols, (v if isinstance(v, int | float | str | None) else str(v) for v in r), strict=True))
        for r in rows[:max_rows]
    ]
    create_table_artifact(
        table=table, key="rollout-sql", description=f"{title} over {root} ({len(rows)} rows)"
    )
    print(f"{title}: {len(rows)} rows")
    return {"columns": cols, "rows": len(rows)}

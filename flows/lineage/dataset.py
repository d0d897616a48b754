"""`grpoflow dataset --sql "SELECT ..." --format FORMAT OUT`: what a query of the store selects, as a
dataset other tools load (rejection sampling, expert iteration, a prompt set for a new run).

Formats (TRL's dataset formats, https://huggingface.co/docs/trl/dataset_formats):

- `trl-sft`: prompt-completion rows, `{"prompt", "completion"}`, for TRL's SFTTrainer. The store's
  `prompt` is the rendered prompt (the chat template applied) and its `completion` the decoded tokens
  after it, so the text is exactly what the model read and wrote: TRL's standard (not conversational)
  form, which SFTTrainer tokenizes as it is. Tool results inside a multi-turn completion are part of
  the completion text; select `num_turns = 1`, or write `jsonl` with `completion_mask`, to leave them out.
- `trl-prompt`: prompt-only rows, `{"prompt", ...}`, for a new GRPO run (TRL's GRPOTrainer hands the
  other selected columns to the reward functions).
- `jsonl`, `parquet`: the selected rows as they are (nested columns kept).

`OUT` is a new directory: the data (`train.jsonl` or `train.parquet`) and `README.md`, a dataset card
whose header tells `datasets.load_dataset(OUT)` which file is the `train` split and whose text names the
query, the runs (when the query selects `run_id`) and the row count. It appears whole or not at all.
"""

from __future__ import annotations

import json
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from grpoflow.flows.config import ConfigError
from grpoflow.flows.lineage.export import check_new_dir
from grpoflow.storage.rollouts import atomic_publish_dir
from grpoflow.storage.sql import query_arrow

# format -> (the columns it needs, whether it keeps the other selected columns)
FORMATS: dict[str, tuple[tuple[str, ...], bool]] = {
    "trl-sft": (("prompt", "completion"), False),
    "trl-prompt": (("prompt",), True),
    "jsonl": ((), True),
    "parquet": ((), True),
}


def export_dataset(root: str | Path, sql: str, fmt: str, out: str | Path) -> dict[str, Any]:
    """Write what `sql` selects from the store at `root` to the new directory `out` as `fmt` (module
    doc); returns the card's fields."""
    if fmt not in FORMATS:
        raise ConfigError(f"--format: {fmt!r} is not one of {', '.join(FORMATS)}")
    out = Path(out)
    check_new_dir(out, "OUT")
    selected = query_arrow(root, sql)
    table = _shaped(selected, fmt)
    if table.num_rows == 0:
        raise ConfigError("--sql: the query selected no rows; nothing was written")
    data = "train.parquet" if fmt == "parquet" else "train.jsonl"
    card = {
        "format": fmt,
        "query": sql.strip(),
        "runs": _runs(selected),
        "rows": table.num_rows,
        "columns": table.column_names,
        "written_at": datetime.now(UTC).isoformat(timespec="seconds"),
    }

    def write(tmp: Path) -> None:
        if fmt == "parquet":
            pq.write_table(table, tmp / data)
        else:
            with open(tmp / data, "w") as f:
                for row in table.to_pylist():
                    f.write(json.dumps(row, ensure_ascii=False, default=str) + "\n")
        (tmp / "README.md").write_text(_card_text(card, data))

    atomic_publish_dir(out, write)
    return card


def _shaped(table: pa.Table, fmt: str) -> pa.Table:
    """`table` with the columns `fmt` writes, or a ConfigError naming the ones the query lacks."""
    needed, keep_others = FORMATS[fmt]
    if missing := [c for c in needed if c not in table.column_names]:
        raise ConfigError(
            f"--format {fmt}: the query selects no {' or '.join(repr(c) for c in missing)} column "
            f"(it needs {', '.join(needed)}; it selected {', '.join(table.column_names) or 'none'})"
        )
    if dupes := sorted({c for c in table.column_names if table.column_names.count(c) > 1}):
        raise ConfigError(f"--sql: the query selects {', '.join(dupes)} twice; name each column once")
    for c in needed:
        if not pa.types.is_string(table.schema.field(c).type):
            raise ConfigError(
                f"--format {fmt}: column {c!r} must be text, the query gives {table.schema.field(c).type}"
            )
    return table if keep_others else table.select(list(needed))


def _runs(table: pa.Table) -> list[str] | None:
    if "run_id" not in table.column_names:
        return None
    return sorted({r for r in table.column("run_id").to_pylist() if r is not None})


def _card_text(card: dict[str, Any], data: str) -> str:
    runs = (
        ", ".join(card["runs"])
        if card["runs"] is not None
        else "not selected (the query has no run_id column)"
    )
    header = [
        "---",
        "configs:",
        "- config_name: default",
        "  data_files:",
        "  - split: train",
        f"    path: {data}",
        "tags:",
        "- grpoflow",
        "---",
    ]
    body = [
        "# A dataset exported from a grpoflow store",
        "",
        f"- format: `{card['format']}`",
        f"- rows: {card['rows']}",
        f"- columns: {', '.join(card['columns'])}",
        f"- runs: {runs}",
        f"- written at: {card['written_at']}",
        "",
        "The query:",
        "",
        "```sql",
        card["query"],
        "```",
        "",
    ]
    return "\n".join(header + body)

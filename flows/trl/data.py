"""A dataset given as an object (datasets' Dataset or IterableDataset, a list of dicts, a pandas DataFrame),
written once into the run's store as Parquet: `--resume`, `grpo-evaluate` and the explorer read the rows
the run trained on, and the flow's parameters name that file instead of carrying the rows."""

from __future__ import annotations

import itertools
import sys
from pathlib import Path
from typing import Any

import pyarrow as pa

from grpoflow.flows.config import ConfigError
from grpoflow.storage.rollouts import atomic_write_parquet

DATASETS_DIR = "datasets"  # <root>/datasets/<run>/{train,eval}.parquet


def dataset_file(root: str | Path, run_id: str, split: str) -> Path:
    return Path(root) / DATASETS_DIR / run_id / f"{split}.parquet"


def rows_of(data: Any, field: str, limit: int | None = None) -> list[dict[str, Any]]:
    """The rows of `data`; an IterableDataset is read up to `limit` rows (what the run can use)."""
    datasets = sys.modules.get("datasets")  # imported by the caller if `data` is one of its datasets
    if datasets is not None and isinstance(data, datasets.IterableDataset):  # possibly endless
        rows = list(itertools.islice(iter(data), limit)) if limit is not None else list(data)
    elif isinstance(data, list | tuple):
        rows = list(data)
    elif hasattr(data, "to_dict") and hasattr(data, "columns"):  # a pandas DataFrame
        rows = data.to_dict("records")
    elif hasattr(data, "keys") and hasattr(data, "values") and not hasattr(data, "column_names"):
        raise ConfigError(
            f"{field}: a dict of splits ({', '.join(map(str, data.keys()))}); pass one split, e.g. {field}=ds['train']"
        )
    elif hasattr(data, "to_list"):  # datasets.Dataset
        rows = data.to_list()
    else:
        raise ConfigError(
            f"{field}: {type(data).__name__} is not a dataset; pass a datasets.Dataset, an IterableDataset, "
            "a list of dicts or a pandas DataFrame"
        )
    for i, row in enumerate(rows):
        if not isinstance(row, dict):
            raise ConfigError(f"{field}: row {i} is a {type(row).__name__}, not a dict of columns")
        if "prompt" not in row:
            raise ConfigError(f"{field}: row {i} has no 'prompt' column (it has {sorted(row)})")
    if not rows:
        raise ConfigError(f"{field}: the dataset has no rows")
    return rows


def keep_rows(rows: list[dict[str, Any]], path: Path, field: str) -> Path:
    """Write `rows` to `path` once (a resumed run keeps the file its first launch wrote)."""
    if path.exists():
        return path
    try:
        table = pa.Table.from_pylist(rows)
    except (pa.ArrowInvalid, pa.ArrowTypeError) as e:
        raise ConfigError(f"{field}: its rows cannot be stored as one table: {e}") from None
    atomic_write_parquet(path, table)
    return path

"""What every tracker shares: the `Tracker` protocol, and what the trackers get from the store (a
step's metrics, the config as params, a step's sample table, a table as markdown)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, ClassVar, Protocol

from grpoflow.flows.config import GRPOConfig
from grpoflow.storage.records import RolloutGroup

# The `steps` columns that are no metric (policy_version is a column and a metric).
NOT_METRICS = ("run_id", "step", "created_at")

# Columns of a sample table before the per-reward ones (`<reward>/status`, `<reward>/value`).
SAMPLE_COLUMNS = ["group", "sample", "prompt", "completion", "reward", "reward_valid", "advantage", "trained"]


class Tracker(Protocol):
    """One tracker. `open` starts a new tracking run (`state` None) or continues the one `state` names,
    and returns the state to persist; `new` says whether it started one (params go only to a new one).
    `flush` makes what was logged durable and returns the state to persist; `close` ends the tracking
    run and returns the state to persist (W&B's cursor moves only there). `name` is its `run.report_to`
    choice (tasks/config/choices.py), `title` how the run's summary names it, `module` the library it
    needs installed."""

    name: ClassVar[str]
    title: ClassVar[str]
    module: ClassVar[str]
    new: bool

    def open(self, state: dict[str, Any] | None) -> dict[str, Any]: ...
    def logged_through(self) -> int: ...
    def log_params(self, params: dict[str, str]) -> None: ...
    def set_tags(self, tags: dict[str, str]) -> None: ...
    def log_step(self, step: int, metrics: dict[str, float], wall_time: float) -> None: ...
    def log_table(self, step: int, columns: list[str], rows: list[list[Any]]) -> None: ...
    def log_images(self, paths: list[Path]) -> None: ...
    def flush(self) -> dict[str, Any]: ...
    def link(self) -> str: ...
    def close(self) -> dict[str, Any]: ...


def step_metrics(row: dict[str, Any]) -> dict[str, float]:
    """A `steps` row's metrics: every numeric column but the row's identity, NULL and NaN left out."""
    out = {}
    for k, v in row.items():
        if k in NOT_METRICS or isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v):
            continue
        out[k] = float(v)
    return out


def _callable_path(obj: Any) -> str:
    # As flows/training/runs.py records a callable given from Python (a reward, tool or environment).
    return f"{getattr(obj, '__module__', '?')}:{getattr(obj, '__qualname__', type(obj).__qualname__)}"


def config_params(cfg: GRPOConfig) -> dict[str, str]:
    """The config as flat params: dotted keys (`learner.lr`, `rewards.0.name`), values as text (JSON for
    anything but a string; a list of plain values is one param)."""
    out: dict[str, str] = {}

    def walk(key: str, v: Any) -> None:
        if isinstance(v, dict) and v:
            for k, sub in v.items():
                walk(f"{key}.{k}" if key else str(k), sub)
        elif isinstance(v, list) and any(isinstance(x, dict | list) for x in v):
            for i, sub in enumerate(v):
                walk(f"{key}.{i}", sub)
        else:
            out[key] = v if isinstance(v, str) else json.dumps(v)

    walk("", cfg.model_dump(mode="json", fallback=_callable_path))
    return out


def _cell(v: Any) -> Any:
    return None if isinstance(v, float) and not math.isfinite(v) else v


def sample_table(groups: list[RolloutGroup]) -> tuple[list[str], list[list[Any]]]:
    """A step's training completions, one row each: prompt, completion, reward, its validity, advantage,
    whether it was trained on, and each reward function's status and value (eval groups left out)."""
    train = [g for g in groups if g.split == "train"]
    names = list(dict.fromkeys(cell.name for g in train for c in g.completions for cell in c.reward_cells))
    columns = SAMPLE_COLUMNS + [f"{n}/{part}" for n in names for part in ("status", "value")]
    rows = []
    for g in train:
        for c in g.completions:
            cells = {cell.name: cell for cell in c.reward_cells}
            row = [
                g.group_id,
                c.sample_index,
                g.prompt_of(c),
                c.completion,
                _cell(c.reward),
                c.reward_valid,
                _cell(c.advantage),
                c.trained,
            ]
            for n in names:
                cell = cells.get(n)
                row += [cell.status, _cell(cell.value)] if cell is not None else [None, None]
            rows.append(row)
    return columns, rows


def _md_cell(v: Any) -> str:
    if v is None:
        return ""
    if isinstance(v, float):
        return f"{v:.6g}"
    return str(v).replace("\\", "\\\\").replace("|", "\\|").replace("\r", "").replace("\n", "<br>")


def markdown_table(columns: list[str], rows: list[list[Any]]) -> str:
    lines = ["| " + " | ".join(_md_cell(c) for c in columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(_md_cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)

"""What a reward function receives beyond the batch's columns, as TRL's GRPOTrainer passes it.

`rewards[].completions: messages` gives a conversational completion as its messages (`completion_messages`);
`trainer_state` is a `TrainerState`; `log_extra` and `log_metric` are a `RewardLog`'s methods, whose
records land in the `rewards` table (an `extra` JSON object per cell) and the `steps` table
(`reward/<reward>/<name>`). Plain data only: the log travels back from a process pool or a Ray task.
"""

from __future__ import annotations

import json
import math
import numbers
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from grpoflow.storage.records import RolloutCompletion

# Metric names grpoflow writes per reward itself (tasks/rewards/score.py); log_metric may not take them.
RESERVED_METRICS = frozenset(
    {"mean", "std", "invalid_rate", "failed_rate", "timeout_rate", "imputed_rate", "seconds"}
)


@dataclass(frozen=True)
class TrainerState:
    """Where training stands when a batch is scored (the fields of TRL's TrainerState reward functions
    read): the step the batch trains (`global_step`), the epochs of data consumed before it, the run's
    steps."""

    global_step: int
    epoch: float
    max_steps: int


def is_conversational(prompt: Any) -> bool:
    return isinstance(prompt, list)


def completion_messages(c: RolloutCompletion) -> list[dict[str, Any]]:
    """A completion as TRL's conversational form: every message after the prompt. An assistant turn
    that called tools carries its `tool_calls` (arguments parsed from the model's JSON when they
    parse), each followed by its tool result message."""
    if not c.messages:  # a record without a trajectory (built by hand): its text is the one turn
        return [{"role": "assistant", "content": c.completion}]
    by_turn: dict[int, list] = {}
    for tc in c.tool_calls:
        by_turn.setdefault(tc.turn, []).append(tc)
    out: list[dict[str, Any]] = []
    turn, pending = -1, []
    for m in c.messages:
        if m.role == "assistant":
            turn += 1
            msg: dict[str, Any] = {"role": "assistant", "content": m.content}
            pending = list(by_turn.get(turn, []))
            if pending:
                msg["tool_calls"] = [
                    {"type": "function", "function": {"name": tc.name, "arguments": _arguments(tc.arguments)}}
                    for tc in pending
                ]
            out.append(msg)
        else:
            msg = {"role": m.role, "content": m.content}
            if m.role == "tool" and pending:
                msg["name"] = pending.pop(0).name
            out.append(msg)
    return out


def _arguments(text: str) -> Any:
    try:
        return json.loads(text)
    except (TypeError, ValueError):
        return text


@dataclass
class RewardLog:
    """What one reward call logged: `log_extra(name, values)` (a value per completion) and
    `log_metric(name, value)` (a number; several calls average). Bad arguments raise at the call, so
    the reward's cells fail with a reason that says why."""

    n: int
    extra: dict[str, list[Any]] = field(default_factory=dict)
    metrics: dict[str, list[float]] = field(default_factory=dict)

    def log_extra(self, name: str, values: Sequence[Any]) -> None:
        if not isinstance(name, str) or not name:
            raise TypeError(f"log_extra: the column name must be a non-empty string, got {name!r}")
        if hasattr(values, "tolist"):
            values = values.tolist()
        if isinstance(values, str | bytes) or not isinstance(values, Sequence) or len(values) != self.n:
            got = f"{len(values)} values" if isinstance(values, Sequence) else type(values).__name__
            raise ValueError(f"log_extra({name!r}): expected {self.n} values, one per completion, got {got}")
        self.extra[name] = [_plain(v) for v in values]

    def log_metric(self, name: str, value: float) -> None:
        if not isinstance(name, str) or not name:
            raise TypeError(f"log_metric: the metric name must be a non-empty string, got {name!r}")
        if name in RESERVED_METRICS:
            raise ValueError(f"log_metric({name!r}): the name is grpoflow's own; choose another")
        if hasattr(value, "item"):
            value = value.item()
        if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
            raise TypeError(f"log_metric({name!r}): expected a finite number, got {value!r}")
        self.metrics.setdefault(name, []).append(float(value))

    def kwargs(self) -> dict[str, Any]:
        return {"log_extra": self.log_extra, "log_metric": self.log_metric}

    def cell_extra(self, i: int) -> dict[str, Any] | None:
        """Completion `i`'s logged columns (None when nothing was logged)."""
        return {k: v[i] for k, v in self.extra.items()} or None

    def metric_means(self, reward: str) -> dict[str, float]:
        return {f"reward/{reward}/{k}": sum(v) / len(v) for k, v in self.metrics.items()}


def _plain(v: Any) -> Any:
    """A logged value as JSON can hold it (numbers, strings, lists, dicts; anything else as its str)."""
    if hasattr(v, "tolist"):
        v = v.tolist()
    try:
        json.dumps(v, allow_nan=False)
        return v
    except (TypeError, ValueError):
        return str(v)


def call_logged(fn: Any, n: int, /, **kwargs: Any) -> tuple[Any, RewardLog]:
    """`fn(**kwargs)` with `log_extra` and `log_metric` of a fresh RewardLog for `n` completions; `fn`
    may be an import path (resolved where this runs: a pool process, a Ray worker). Returns the values
    (numpy arrays and tensors as lists) and the log."""
    from grpoflow.tasks.config.imports import import_object

    log = RewardLog(n)
    out = (import_object(fn) if isinstance(fn, str) else fn)(**kwargs, **log.kwargs())
    return (out.tolist() if hasattr(out, "tolist") else out), log

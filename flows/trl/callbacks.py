"""TRL's view of a run's steps: `state.log_history` entries under TRL's metric names, the reading
callbacks it calls (`on_step_end`, `on_log`, `on_train_end`), and a notebook progress bar.

All of it comes from the store: a step's `steps` row and its rollouts (completion lengths). TRL counts
optimizer steps: grpoflow's step s is TRL's global step (s + 1) x optimizer steps per generation batch.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from grpoflow.flows.config import ConfigError
from grpoflow.storage.sql import query

# The callback events grpoflow calls; a callback overriding another one would be silently skipped.
EVENTS = ("on_log", "on_step_end", "on_train_end")

# TRL's name <- the `steps` column
RENAMES = {
    "loss": "train/loss",
    "grad_norm": "train/grad_norm",
    "learning_rate": "train/lr",
    "reward": "reward/mean",
    "reward_std": "reward/std",
    "kl": "train/kl",
    "clip_ratio/low_mean": "train/clip_frac_low",
    "clip_ratio/high_mean": "train/clip_frac_high",
    "sampling/importance_sampling_ratio/mean": "train/is_weight_mean",
}

# Per step in [$first, $last]: completion lengths, and TRL's num_tokens (prompt and completion tokens of
# every step up to it: the sum runs from step 0, so it holds across a resume and needs no state here).
LENGTHS_SQL = """
WITH per_step AS (
    SELECT step,
           avg(completion_tokens) AS mean, min(completion_tokens) AS lo, max(completion_tokens) AS hi,
           avg(CAST(truncated AS DOUBLE)) AS clipped,
           avg(completion_tokens) FILTER (WHERE NOT truncated) AS t_mean,
           min(completion_tokens) FILTER (WHERE NOT truncated) AS t_lo,
           max(completion_tokens) FILTER (WHERE NOT truncated) AS t_hi,
           sum(len(prompt_ids) + completion_tokens) AS tokens
    FROM rollouts WHERE run_id = $run AND split = 'train' AND step <= $last
    GROUP BY step
)
SELECT step, mean, lo, hi, clipped, t_mean, t_lo, t_hi, sum(tokens) OVER (ORDER BY step)
FROM per_step QUALIFY step >= $first ORDER BY step
"""
LENGTH_KEYS = (
    "completions/mean_length",
    "completions/min_length",
    "completions/max_length",
    "completions/clipped_ratio",
    "completions/mean_terminated_length",
    "completions/min_terminated_length",
    "completions/max_terminated_length",
)


def check_callbacks(callbacks: list[Any] | None) -> list[Any]:
    """TRL's callbacks (instances, or classes TRL would build), each overriding only EVENTS."""
    from transformers import TrainerCallback

    out = []
    for i, cb in enumerate(callbacks or []):
        cb = cb() if isinstance(cb, type) else cb
        if not isinstance(cb, TrainerCallback):
            raise ConfigError(f"callbacks[{i}]: {type(cb).__name__} is not a transformers TrainerCallback")
        others = [
            name
            for name in dir(TrainerCallback)
            if name.startswith("on_")
            and name not in EVENTS
            and getattr(type(cb), name) is not getattr(TrainerCallback, name)
        ]
        if others:
            raise ConfigError(
                f"callbacks[{i}]: {type(cb).__name__} overrides {', '.join(others)}, which grpoflow does not call: "
                f"a callback may read a run through {', '.join(EVENTS)} only"
            )
        out.append(cb)
    return out


class StepLog:
    """Turns grpoflow steps into TRL log entries for one run."""

    def __init__(
        self, root: str | Path, run_id: str, per_batch: int, rows_per_epoch: int | None, prompts: int
    ):
        self.root, self.run_id, self.per_batch = root, run_id, per_batch
        self.rows_per_epoch, self.prompts = rows_per_epoch, prompts

    def global_step(self, step: int) -> int:
        return (step + 1) * self.per_batch

    def epoch(self, step: int) -> float | None:
        return (step + 1) * self.prompts / self.rows_per_epoch if self.rows_per_epoch else None

    def entries(self, rows: list[dict[str, Any]]) -> list[dict[str, float]]:
        """TRL's log entries of `rows` (the steps rows, in step order)."""
        if not rows:
            return []
        _, found = query(
            self.root, LENGTHS_SQL, {"run": self.run_id, "first": rows[0]["step"], "last": rows[-1]["step"]}
        )
        lengths = {r[0]: r[1:] for r in found}
        return [self.entry(row["step"], row, lengths.get(row["step"])) for row in rows]

    def entry(self, step: int, row: dict[str, Any], lengths: tuple | None) -> dict[str, float]:
        out: dict[str, float] = {}
        for trl_name, column in RENAMES.items():
            _put(out, trl_name, row.get(column))
        for key, value in row.items():
            parts = key.split("/")
            if len(parts) == 3 and parts[0] == "reward" and parts[2] in ("mean", "std"):
                _put(out, f"rewards/{parts[1]}/{parts[2]}", value)
        if out.get("clip_ratio/low_mean") is not None and out.get("clip_ratio/high_mean") is not None:
            out["clip_ratio/region_mean"] = out["clip_ratio/low_mean"] + out["clip_ratio/high_mean"]
        groups = row.get("adv/groups")
        if groups:
            _put(out, "frac_reward_zero_std", (row.get("adv/groups_zero_std") or 0.0) / groups)
        completions, calls = row.get("gen/completions"), row.get("gen/tool_calls")
        if completions and calls is not None:
            _put(out, "tools/call_frequency", calls / completions)
            if calls:
                _put(out, "tools/failure_frequency", (row.get("gen/tool_failures") or 0.0) / calls)
        if lengths is not None:
            for key, value in zip(LENGTH_KEYS, lengths[:-1], strict=True):
                _put(out, key, value)
            _put(out, "num_tokens", lengths[-1])
        _put(out, "epoch", self.epoch(step))
        out["step"] = self.global_step(step)
        return out


def _put(out: dict[str, float], key: str, value: Any) -> None:
    if isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value):
        out[key] = float(value)


class Callbacks:
    """A step listener (flows/training/step_close.py) that keeps TRL's `state` and calls the callbacks:
    `on_step_end` every step, `on_log` every `logging_steps`; and moves the progress bar."""

    def __init__(self, args: Any, state: Any, callbacks: list[Any], log: StepLog, every: int, bar: Any):
        from transformers import TrainerControl

        self.args, self.state, self.callbacks, self.log = args, state, callbacks, log
        self.every, self.bar, self.control = every, bar, TrainerControl()

    def __call__(self, step: int, row: dict[str, Any]) -> None:
        self.state.global_step, self.state.epoch = self.log.global_step(step), self.log.epoch(step)
        if self.bar is not None:
            self.bar.update(1)
            if row.get("reward/mean") is not None:
                self.bar.set_postfix(reward=f"{row['reward/mean']:.3f}", refresh=False)
        for cb in self.callbacks:
            cb.on_step_end(self.args, self.state, self.control)
        if self.state.global_step % self.every == 0:  # the store is read for logged steps only
            entry = self.log.entries([{**row, "step": step}])[0]
            self.state.log_history.append(entry)
            for cb in self.callbacks:
                cb.on_log(self.args, self.state, self.control, logs=entry)

    def end(self) -> None:
        for cb in self.callbacks:
            cb.on_train_end(self.args, self.state, self.control)

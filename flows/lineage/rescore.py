"""`grpoflow rescore RUN --reward NAME=module:fn [...]`: a run's stored completions scored again by other
reward functions ("my reward had a bug: what would the fixed one have said?").

Every completion of RUN (train and eval) goes through the live run's scorer (tasks/rewards/score.py:
concurrency, timeouts, `failed` / `invalid` / `timeout` cells, never a 0 for a failure) with the row
columns of its prompt, found by `row_id` in the run's own dataset (its recorded config's `data`), as
the live rewards had them. The cells land in the `rescores` table under the rescore's name and a new
version (storage/rescores.py); the run's own files are never written. A reward that scores no
completion at all (every cell failed, timed out or invalid) is a broken reward, not data: nothing is
written and the command says why. `grpoflow sql --canned rescore_disagreements --run RUN` lists the
completions a rescore judged otherwise than the run did.
"""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path
from typing import Any

from grpoflow.flows.config import ConfigError, GRPOConfig
from grpoflow.storage.ids import validate_run_id
from grpoflow.storage.rescores import write_rescore
from grpoflow.storage.rollouts import RolloutStore
from grpoflow.storage.tables import reward_rows
from grpoflow.tasks.config.rewards import RewardConfig
from grpoflow.tasks.rewards.broken_rewards import BrokenRewardError


class BrokenRescore(BrokenRewardError):
    """A reward of the rescore scored no completion: nothing was written (the message says why)."""


def reward_specs(specs: list[str]) -> list[RewardConfig]:
    """`NAME=module:fn` strings as reward configs (weight 1, the live defaults otherwise), each function
    imported now: a wrong one is refused before any completion is read."""
    from grpoflow.tasks.rewards.score import RewardImportError, resolve_reward

    out = []
    for s in specs:
        name, sep, fn = s.partition("=")
        if not sep or not name.strip() or ":" not in fn:
            raise ConfigError(f"--reward: expected NAME=module:function, got {s!r}")
        spec = RewardConfig(name=name.strip(), fn=fn.strip())
        try:
            resolve_reward(spec)
        except RewardImportError as e:
            raise ConfigError(f"--reward {name.strip()}: {e}") from None
        out.append(spec)
    if not out:
        raise ConfigError("--reward: name at least one reward, as NAME=module:function")
    if len({s.name for s in out}) < len(out):
        raise ConfigError("--reward: each reward needs a name of its own")
    return out


def rescore_run(
    root: str | Path, run_id: str, specs: list[RewardConfig], name: str = "rescore"
) -> dict[str, Any]:
    """Score every stored completion of `run_id` with `specs` and publish the cells as its next
    rescore named `name` (module doc). Returns the version, the path and each reward's cell counts."""
    from grpoflow.tasks.rewards.score import score_groups

    store = RolloutStore(root)
    run_id = validate_run_id(run_id)
    if (meta := store.read_run_meta(run_id)) is None:
        raise ConfigError(f"RUN: no run {run_id!r} in {root}")
    steps = store.steps_written("rollouts", run_id)
    if not steps:
        raise ConfigError(f"RUN: run {run_id!r} has no stored completions to rescore")
    rows = _rows_by_id(run_id, meta)
    cells: list[dict[str, Any]] = []
    for step in steps:
        groups = store.read_groups(run_id, step)
        for g in groups:
            g.row = rows.get(g.row_id, {})
        score_groups(groups, specs)
        cells += reward_rows(groups, run_id=run_id, step=step)
    counts = {s.name: Counter(c["status"] for c in cells if c["reward_name"] == s.name) for s in specs}
    if broken := [n for n, k in counts.items() if not k["valid"]]:
        reasons = {c["reward_name"]: c["reason"] for c in cells if c["reward_name"] in broken}
        raise BrokenRescore(
            "; ".join(
                f"reward {n!r} scored no completion of {run_id} ({reasons[n] or 'no reason given'})"
                for n in broken
            )
            + ": nothing was written"
        )
    version, path = write_rescore(root, run_id, name, cells)
    return {
        "run": run_id,
        "rescore": name,
        "version": version,
        "path": str(path),
        "cells": len(cells),
        "statuses": {n: dict(k) for n, k in counts.items()},
    }


def _rows_by_id(run_id: str, meta: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The run's dataset rows by `row_id`, from its recorded config (`meta`, its run record); {} (prompts
    and completions only, said on stderr) when that dataset cannot be read any more."""
    from grpoflow.flows.training.data import load_rows
    from grpoflow.storage.ids import row_id_of

    try:
        cfg = GRPOConfig.model_validate(meta.get("config") or {})
        return {row_id_of(r): r for r in load_rows(cfg)}
    except Exception as e:  # any reason the dataset is gone is reported, not raised
        print(
            f"note: {run_id}'s dataset cannot be read ({str(e).splitlines()[0]}): the rewards get "
            "prompts and completions, no other row columns",
            file=sys.stderr,
        )
        return {}

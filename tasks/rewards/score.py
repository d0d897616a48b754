"""Concurrent reward scoring with a status for every (completion, reward function) cell.

All reward functions of a batch run at once: `async def` ones each on their own event loop, sync ones
on daemon threads (or a process pool for CPU-bound functions, or Ray tasks on a cluster), a reward
`model` on a thread of its own, each under its own timeout. They get TRL's keywords
(tasks/rewards/reward_kwargs.py). A result is `valid`, `invalid` (None/NaN/inf), `failed` (exception, wrong
length, non-numeric) or `timeout`; nothing is silently turned into 0. An optional reward's missing
value is imputed with its group's mean (neutral for the advantage), the cell keeping its status.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import inspect
import math
import numbers
import statistics
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any

from grpoflow.storage.faults import failpoint
from grpoflow.storage.records import (
    NOT_ITS_ENVIRONMENT,
    RewardCell,
    RewardStatus,
    RolloutCompletion,
    RolloutGroup,
)
from grpoflow.tasks.config.imports import import_object
from grpoflow.tasks.config.rewards import RewardConfig
from grpoflow.tasks.remote import call_on_ray, this_node
from grpoflow.tasks.rewards.env_reward import ENVIRONMENT_REWARD, EnvReward
from grpoflow.tasks.rewards.process_pool import in_process_pool
from grpoflow.tasks.rewards.reward_kwargs import (
    RewardLog,
    TrainerState,
    call_logged,
    completion_messages,
    is_conversational,
)
from grpoflow.tasks.rewards.vf_reward import VERIFIERS_REWARD, cell_of
from grpoflow.tasks.threads import in_daemon_thread, run_blocking


class RewardImportError(ImportError):
    """A reward function's import path cannot be resolved."""


def resolve_reward(spec: RewardConfig) -> Callable[..., Any]:
    if callable(spec.fn):
        return spec.fn
    try:
        return import_object(spec.fn)
    except (ImportError, AttributeError, ValueError) as e:
        raise RewardImportError(f"reward {spec.name!r}: cannot import {spec.fn!r}: {e}") from e


def _call_module(fn: Any, n: int, kwargs: dict[str, Any]) -> tuple[Any, RewardLog]:
    import torch

    with torch.no_grad():
        return call_logged(fn, n, **kwargs)


def _batch_inputs(groups: list[RolloutGroup]) -> dict[str, list[Any]]:
    """Flatten groups into TRL-style column lists, one element per completion (completions as text)."""
    cols: dict[str, list[Any]] = {"prompts": [], "completions": [], "completion_ids": [], "environments": []}
    extra = sorted({k for g in groups for k in g.row if k != "prompt"})
    for k in extra:
        cols[k] = []
    for g in groups:
        for c in g.completions:
            cols["prompts"].append(g.prompt_input_of(c))
            cols["completions"].append(c.completion)
            cols["completion_ids"].append(c.completion_ids)
            cols["environments"].append(c.environment)
            for k in extra:
                cols[k].append(g.row.get(k))
    return cols


def _as_messages(groups: list[RolloutGroup], inputs: dict[str, list[Any]]) -> dict[str, list[Any]]:
    """`inputs` with each completion of a conversational prompt as its messages (TRL's form)."""
    comps = [c for g in groups for c in g.completions]
    as_messages = [
        completion_messages(c) if is_conversational(p) else text
        for c, p, text in zip(comps, inputs["prompts"], inputs["completions"], strict=True)
    ]
    return {**inputs, "completions": as_messages}


def _cells_from_values(
    spec: RewardConfig, values: Any, n: int, seconds: float, node: str
) -> list[RewardCell]:
    def cell(value, status, reason=""):
        return RewardCell(spec.name, value, status, reason, spec.weight, seconds, node=node)

    if hasattr(values, "tolist"):  # numpy arrays and torch tensors
        values = values.tolist()
    if isinstance(values, str | bytes) or not isinstance(values, Sequence):
        return [cell(None, "failed", f"returned {type(values).__name__}, expected a list of {n} numbers")] * n
    values = list(values)
    if len(values) != n:
        return [cell(None, "failed", f"wrong length: expected {n} values, got {len(values)}")] * n
    return [cell(*classify(v)) for v in values]


def classify(v: Any) -> tuple[float | None, RewardStatus, str]:
    """One returned value as a cell's (value, status, reason)."""
    if v is None:
        return None, "invalid", "returned None"
    if isinstance(v, bool) or not isinstance(v, numbers.Real):
        # bool is numeric in Python but almost always a bug in a reward (a predicate, not a score)
        return None, "failed", f"non-numeric value {v!r} ({type(v).__name__})"
    if not math.isfinite(float(v)):
        return None, "invalid", f"non-finite value {float(v)}"
    return float(v), "valid", ""


def _environment_cell(
    c: RolloutCompletion, spec: RewardConfig
) -> tuple[float | None, RewardStatus, str, float]:
    """An environment's get_reward() cell (tasks/rewards/env_reward.py): the outcome its rollout recorded."""
    got: EnvReward | None = c.environment_reward
    if got is None:
        return None, "invalid", "the rollout recorded no get_reward()", 0.0
    if got.status is not None:
        return None, got.status, got.reason, got.seconds
    return (*classify(got.value), got.seconds)


def _verifiers_cell(
    c: RolloutCompletion, spec: RewardConfig
) -> tuple[float | None, RewardStatus, str, float]:
    """A verifiers reward's cell (tasks/rewards/vf_reward.py): its score in the rollout's episode."""
    return (*cell_of(c.verifiers, spec.name), 0.0)


# Rewards whose cells each rollout recorded as it ran (never called): the cell of one completion.
RECORDED = {ENVIRONMENT_REWARD: _environment_cell, VERIFIERS_REWARD: _verifiers_cell}


def _recorded_cells(spec: RewardConfig, groups: list[RolloutGroup]) -> list[RewardCell]:
    node, cell, envs = this_node(), RECORDED[spec.fn], spec.kwargs.get("environments")
    mine = lambda g: envs is None or g.row.get("environment") in envs  # noqa: E731 (its class's rollouts)
    return [
        RewardCell(spec.name, value, status, reason[:500], spec.weight, dt, node=node)
        for value, status, reason, dt in (
            cell(c, spec) if mine(g) else (None, "invalid", NOT_ITS_ENVIRONMENT, 0.0)
            for g in groups
            for c in g.completions
        )
    ]


def _error_cells(
    spec: RewardConfig,
    status: RewardStatus,
    reason: str,
    n: int,
    t0: float,
    node: str,
    trace: str | None = None,
) -> list[RewardCell]:
    dt = time.perf_counter() - t0
    return [RewardCell(spec.name, None, status, reason[:500], spec.weight, dt, node=node, trace=trace)] * n


async def _run_one(
    spec: RewardConfig, inputs: dict[str, list[Any]], state: TrainerState | None
) -> tuple[list[RewardCell], RewardLog]:
    """One reward over the batch: its cells, and what it logged (nothing when it failed)."""
    n = len(inputs["completions"])
    kwargs = {**inputs, "trainer_state": state, **spec.kwargs}
    t0 = time.perf_counter()
    deadline = asyncio.timeout(spec.timeout_s)
    # Where it runs: this process, or the Ray node its task reports ("" when a task is cut off unheard)
    on_ray = _on_ray(spec)
    node = "" if on_ray else this_node()
    try:
        async with deadline:
            values, log, node = await _call(spec, kwargs, n, node, on_ray)
    except TimeoutError as e:
        # Only our own deadline is a `timeout`; a TimeoutError the function raised (its HTTP client
        # gave up, say) is the function failing, and its message says why.
        if deadline.expired():
            return _error_cells(spec, "timeout", f"exceeded {spec.timeout_s}s", n, t0, node), RewardLog(n)
        return _failed(spec, e, n, t0, node), RewardLog(n)
    except Exception as e:
        return _failed(spec, e, n, t0, node), RewardLog(n)
    cells = _cells_from_values(spec, values, n, time.perf_counter() - t0, node)
    if log.extra:  # a copy per completion: a failed batch's cells are one object n times
        cells = [dataclasses.replace(c, extra=log.cell_extra(i)) for i, c in enumerate(cells)]
    return cells, log


async def _score_one(spec: RewardConfig, groups, messages, text, state) -> tuple[list[RewardCell], RewardLog]:
    if isinstance(spec.fn, str) and spec.fn in RECORDED:  # get_reward(), a verifiers episode: recorded
        return _recorded_cells(spec, groups), RewardLog(len(text["completions"]))
    return await _run_one(spec, messages if spec.completions == "messages" else text, state)


def _failed(spec: RewardConfig, e: Exception, n: int, t0: float, node: str) -> list[RewardCell]:
    trace = "".join(traceback.format_exception(e))
    node = getattr(e, "ray_node", None) or node  # raised in a Ray task: where it ran
    return _error_cells(spec, "failed", f"{type(e).__name__}: {e}", n, t0, node, trace)


async def _awaited(fn: Any, n: int, kwargs: dict[str, Any]) -> tuple[Any, RewardLog]:
    log = RewardLog(n)
    out = await fn(**kwargs, **log.kwargs())
    return (out.tolist() if hasattr(out, "tolist") else out), log


async def _call(
    spec: RewardConfig, kwargs: dict[str, Any], n: int, node: str, on_ray: bool
) -> tuple[Any, RewardLog, str]:
    """The function's values and log, and the node that ran it (`node`: this process's)."""
    if on_ray:
        # a Ray task; at the timeout the cancelled await kills its worker (tasks/remote.py)
        no_env = {**kwargs, "environments": [None] * n}  # environments stay local, as for the pool
        (values, log), node = await call_on_ray(
            functools.partial(call_logged, spec.fn, n), no_env, spec.num_cpus
        )
        return values, log, node
    return (*await _call_here(spec, kwargs, n), node)


def _on_ray(spec: RewardConfig) -> bool:
    """Whether this reward runs as a Ray task (an async function runs on its own loop here)."""
    if spec.executor != "ray" or spec.model is not None:
        return False
    try:
        return not _is_async(resolve_reward(spec))
    except Exception:  # a bad import path: the call raises it again, as the cells' reason
        return False


def _is_async(fn: Any) -> bool:
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(type(fn).__call__)


async def _call_here(spec: RewardConfig, kwargs: dict[str, Any], n: int) -> tuple[Any, RewardLog]:
    if spec.model is not None:
        return await in_daemon_thread(_call_reward_model, spec, n, kwargs)
    fn = resolve_reward(spec)
    if _is_async(fn):
        # Its own event loop on a daemon thread: an `async def` that blocks (time.sleep, sync I/O)
        # stalls only itself, not the batch's other rewards, and is abandoned at its timeout.
        return await in_daemon_thread(asyncio.run, _awaited(fn, n, kwargs))
    if spec.executor == "process":
        if not isinstance(spec.fn, str):
            raise TypeError("executor='process' needs an import path 'module:function'")
        no_env = {**kwargs, "environments": [None] * n}  # environments rarely pickle; documented
        return await in_process_pool(functools.partial(call_logged, spec.fn, n, **no_env))
    if _is_module(fn):
        return await in_daemon_thread(_call_module, fn, n, kwargs)
    # a daemon thread: a hung function is abandoned at its timeout, never joined
    return await in_daemon_thread(call_logged, fn, n, **kwargs)


def _call_reward_model(spec: RewardConfig, n: int, kwargs: dict[str, Any]) -> tuple[list[float], RewardLog]:
    """A reward `model`: loaded once per run (the first batch's load counts against its timeout)."""
    from grpoflow.tasks.rewards.reward_model import reward_model

    model = reward_model(spec.model, spec.device)
    return model.score(kwargs["prompts"], kwargs["completions"], spec.batch_size), RewardLog(n)


def _is_module(fn: Any) -> bool:
    # An nn.Module instance implies torch is imported already; importing it here just to say "no"
    # would cost seconds inside the first batch's timeouts.
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(fn, torch.nn.Module)


def _impute(rows: list[list[RewardCell]], specs: list[RewardConfig]) -> list[list[RewardCell]]:
    """Per-completion copies of one group's cells, with each optional reward's missing cells imputed.

    Scoring a missing optional value as 0 would move that completion against its group; the mean of
    the reward's valid values over the group's scored completions (required rewards all valid: the
    ones in the advantage baseline) is neutral. No valid value in the group: nothing is imputed.
    """
    out = [[RewardCell(**vars(x)) for x in cells] for cells in rows]
    scored = [
        all(x.status == "valid" for x, s in zip(cells, specs, strict=True) if s.required and x.applies)
        for cells in rows
    ]
    for j, spec in enumerate(specs):
        if spec.required:
            continue
        seen = [
            cells[j].value for cells, ok in zip(out, scored, strict=True) if ok and cells[j].status == "valid"
        ]
        for cells, ok in zip(out, scored, strict=True):
            if seen and ok and cells[j].status != "valid" and cells[j].applies:
                cells[j].imputed, cells[j].imputed_value = True, sum(seen) / len(seen)
    return out


def _apply(groups: list[RolloutGroup], specs: list[RewardConfig], per_fn: list[list[RewardCell]]) -> None:
    i = 0
    for g in groups:
        rows = [[col[i + k] for col in per_fn] for k in range(len(g.completions))]
        i += len(g.completions)
        for c, cells in zip(g.completions, _impute(rows, specs), strict=True):
            c.reward_cells = cells
            bad = [
                f"{x.name}: {x.status}: {x.reason}"
                for x, s in zip(cells, specs, strict=True)
                if s.required and x.status != "valid" and x.applies
            ]
            c.reward_valid = not bad
            notes = [
                f"{x.name} (optional): {x.status}: {x.reason}"
                + (f" (imputed group mean {x.imputed_value:.4g})" if x.imputed else "")
                for x, s in zip(cells, specs, strict=True)
                if not s.required and x.status != "valid" and x.applies
            ]
            c.invalid_reason = "; ".join(bad + notes) or None
            c.reward = (
                sum(
                    x.weight * (x.value if x.status == "valid" else x.imputed_value)
                    for x in cells
                    if x.status == "valid" or x.imputed
                )
                if c.reward_valid
                else None
            )


def _stats(xs: list[float]) -> tuple[float | None, float | None]:
    """Mean and population std of a reward's valid values (None, None when there are none)."""
    return (statistics.fmean(xs), statistics.pstdev(xs)) if xs else (None, None)


def _metrics(groups, specs, per_fn, seconds: float) -> dict[str, float | None]:
    out: dict[str, float | None] = {"score_seconds": seconds}
    for spec, cells in zip(specs, per_fn, strict=True):
        cells = [c for c in cells if c.applies]  # another environment's rollouts: not this reward's
        n = max(1, len(cells))
        mean, std = _stats([c.value for c in cells if c.status == "valid"])
        p = f"reward/{spec.name}"
        out[f"{p}/mean"], out[f"{p}/std"] = mean, std
        for status in ("invalid", "failed", "timeout"):
            out[f"{p}/{status}_rate"] = sum(c.status == status for c in cells) / n
        imputed = [
            x.imputed for g in groups for c in g.completions for x in c.reward_cells if x.name == spec.name
        ]
        out[f"{p}/imputed_rate"] = sum(imputed) / n
        out[f"{p}/seconds"] = max((c.duration_s for c in cells), default=0.0)
    comps = [c for g in groups for c in g.completions]
    mean, std = _stats([c.reward for c in comps if c.reward_valid])
    out["reward/mean"], out["reward/std"] = mean, std
    out["reward/valid_frac"] = sum(c.reward_valid for c in comps) / max(1, len(comps))
    return out


def reward_metrics(groups: list[RolloutGroup], specs: list[RewardConfig]) -> dict[str, float | None]:
    """The reward figures of already scored groups (`score_groups_async`'s, score_seconds aside): a
    step whose groups were scored in several rounds (dynamic sampling) reports them over all."""
    per_fn = [
        [x for g in groups for c in g.completions for x in c.reward_cells if x.name == s.name] for s in specs
    ]
    out = _metrics(groups, specs, per_fn, 0.0)
    del out["score_seconds"]
    return out


async def score_groups_async(
    groups: list[RolloutGroup], specs: list[RewardConfig], state: TrainerState | None = None
) -> dict[str, float | None]:
    """Score every completion with every reward, concurrently; fills the completions in place.
    `state`: what reward functions get as `trainer_state` (where training stands)."""
    t0 = time.perf_counter()
    text = _batch_inputs(groups)
    messages = _as_messages(groups, text) if any(s.completions == "messages" for s in specs) else text
    runs = await asyncio.gather(*(_score_one(s, groups, messages, text, state) for s in specs))
    failpoint("score")
    per_fn = [cells for cells, _ in runs]
    _apply(groups, specs, per_fn)
    metrics = _metrics(groups, specs, per_fn, time.perf_counter() - t0)
    for spec, (_, log) in zip(specs, runs, strict=True):
        metrics.update(log.metric_means(spec.name))
    return metrics


def score_groups(
    groups: list[RolloutGroup], specs: list[RewardConfig], state: TrainerState | None = None
) -> dict[str, float | None]:
    """Sync entry point; works inside a running event loop too (runs on a helper thread's loop)."""
    return run_blocking(score_groups_async(groups, specs, state))

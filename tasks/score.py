"""Concurrent reward scoring with a status for every (completion, reward function) cell.

All reward functions of a batch run at once: `async def` ones on the current event loop, sync ones
on a thread pool (or a process pool for CPU-bound functions), each under its own timeout. A result
is `valid`, `invalid` (None/NaN/inf), `failed` (exception, wrong length, non-numeric) or `timeout`;
nothing is silently turned into 0.
"""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import inspect
import math
import multiprocessing as mp
import numbers
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from prefect import task
from prefect.cache_policies import NO_CACHE

from storage.faults import failpoint
from storage.records import RewardCell, RolloutGroup
from tasks.imports import import_object
from tasks.threads import in_daemon_thread


class RewardImportError(ImportError):
    """A reward function's import path cannot be resolved."""


@dataclass
class RewardSpec:
    name: str
    fn: str | Callable[..., Any]  # 'module:function' or a callable (incl. an nn.Module reward model)
    weight: float = 1.0
    timeout_s: float = 30.0
    executor: Literal["thread", "process"] = "thread"
    required: bool = True
    kwargs: dict[str, Any] = field(default_factory=dict)


def resolve_reward(spec: RewardSpec) -> Callable[..., Any]:
    if callable(spec.fn):
        return spec.fn
    try:
        return import_object(spec.fn)
    except (ImportError, AttributeError, ValueError) as e:
        raise RewardImportError(f"reward {spec.name!r}: cannot import {spec.fn!r}: {e}") from e


def _call_by_path(path: str, kwargs: dict[str, Any]) -> Any:
    """Process-pool entry point: the child imports the function itself (functions don't pickle well)."""
    return import_object(path)(**kwargs)


def _call_module(fn: Any, kwargs: dict[str, Any]) -> Any:
    import torch

    with torch.no_grad():
        out = fn(**kwargs)
    return out.tolist() if hasattr(out, "tolist") else out


def _batch_inputs(groups: list[RolloutGroup]) -> dict[str, list[Any]]:
    """Flatten groups into TRL-style column lists, one element per completion."""
    cols: dict[str, list[Any]] = {"prompts": [], "completions": [], "completion_ids": [], "environments": []}
    extra = sorted({k for g in groups for k in g.row if k != "prompt"})
    for k in extra:
        cols[k] = []
    for g in groups:
        for c in g.completions:
            own = c.prompt_input  # the prompt this completion was generated from (reset notes included)
            cols["prompts"].append(own if own is not None else g.row.get("prompt", g.prompt))
            cols["completions"].append(c.completion)
            cols["completion_ids"].append(c.completion_ids)
            cols["environments"].append(c.environment)
            for k in extra:
                cols[k].append(g.row.get(k))
    return cols


def _cells_from_values(spec: RewardSpec, values: Any, n: int, seconds: float) -> list[RewardCell]:
    def cell(value, status, reason=""):
        return RewardCell(spec.name, value, status, reason, spec.weight, seconds)

    if hasattr(values, "tolist"):  # numpy arrays and torch tensors
        values = values.tolist()
    if isinstance(values, str | bytes) or not isinstance(values, Sequence):
        return [cell(None, "failed", f"returned {type(values).__name__}, expected a list of {n} numbers")] * n
    values = list(values)
    if len(values) != n:
        return [cell(None, "failed", f"wrong length: expected {n} values, got {len(values)}")] * n
    out = []
    for v in values:
        if v is None:
            out.append(cell(None, "invalid", "returned None"))
        elif isinstance(v, bool) or not isinstance(v, numbers.Real):
            # bool is numeric in Python but almost always a bug in a reward (a predicate, not a score)
            out.append(cell(None, "failed", f"non-numeric value {v!r} ({type(v).__name__})"))
        elif not math.isfinite(float(v)):
            out.append(cell(None, "invalid", f"non-finite value {float(v)}"))
        else:
            out.append(cell(float(v), "valid"))
    return out


async def _run_one(
    spec: RewardSpec, inputs: dict[str, list[Any]], pools: dict[str, cf.Executor]
) -> list[RewardCell]:
    n = len(inputs["completions"])
    kwargs = {**inputs, **spec.kwargs}
    t0 = time.perf_counter()
    loop = asyncio.get_running_loop()
    try:
        fn = resolve_reward(spec)
        if inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(type(fn).__call__):
            coro = fn(**kwargs)
        elif spec.executor == "process":
            if not isinstance(spec.fn, str):
                raise TypeError("executor='process' needs an import path 'module:function'")
            no_env = {**kwargs, "environments": [None] * n}  # environments rarely pickle; documented
            coro = loop.run_in_executor(pools["process"], _call_by_path, spec.fn, no_env)
        elif _is_module(fn):
            coro = in_daemon_thread(_call_module, fn, kwargs)
        else:  # a daemon thread: a hung function is abandoned at its timeout, never joined
            coro = in_daemon_thread(fn, **kwargs)
        values = await asyncio.wait_for(coro, timeout=spec.timeout_s)
    except TimeoutError:
        dt = time.perf_counter() - t0
        return [RewardCell(spec.name, None, "timeout", f"exceeded {spec.timeout_s}s", spec.weight, dt)] * n
    except Exception as e:
        dt = time.perf_counter() - t0
        reason = f"{type(e).__name__}: {e}"[:500]
        return [RewardCell(spec.name, None, "failed", reason, spec.weight, dt)] * n
    return _cells_from_values(spec, values, n, time.perf_counter() - t0)


def _is_module(fn: Any) -> bool:
    try:
        import torch

        return isinstance(fn, torch.nn.Module)
    except ImportError:
        return False


def _apply(groups: list[RolloutGroup], specs: list[RewardSpec], per_fn: list[list[RewardCell]]) -> None:
    i = 0
    for g in groups:
        for c in g.completions:
            cells = [col[i] for col in per_fn]
            c.reward_cells = [RewardCell(**vars(x)) for x in cells]  # per-completion copies
            bad = [
                f"{x.name}: {x.status}: {x.reason}"
                for x, s in zip(cells, specs, strict=True)
                if s.required and x.status != "valid"
            ]
            c.reward_valid = not bad
            notes = [
                f"{x.name} (optional): {x.status}: {x.reason}"
                for x, s in zip(cells, specs, strict=True)
                if not s.required and x.status != "valid"
            ]
            c.invalid_reason = "; ".join(bad + notes) or None
            c.reward = (
                sum(x.weight * x.value for x in cells if x.status == "valid") if c.reward_valid else None
            )
            i += 1


def _stats(xs: list[float]) -> tuple[float | None, float | None]:
    if not xs:
        return None, None
    m = sum(xs) / len(xs)
    return m, math.sqrt(sum((x - m) ** 2 for x in xs) / len(xs))


def _metrics(groups, specs, per_fn, seconds: float) -> dict[str, float | None]:
    out: dict[str, float | None] = {"score_seconds": seconds}
    for spec, cells in zip(specs, per_fn, strict=True):
        n = max(1, len(cells))
        mean, std = _stats([c.value for c in cells if c.status == "valid"])
        p = f"reward/{spec.name}"
        out[f"{p}/mean"], out[f"{p}/std"] = mean, std
        for status in ("invalid", "failed", "timeout"):
            out[f"{p}/{status}_rate"] = sum(c.status == status for c in cells) / n
        out[f"{p}/seconds"] = max((c.duration_s for c in cells), default=0.0)
    comps = [c for g in groups for c in g.completions]
    mean, std = _stats([c.reward for c in comps if c.reward_valid])
    out["reward/mean"], out["reward/std"] = mean, std
    out["reward/valid_frac"] = sum(c.reward_valid for c in comps) / max(1, len(comps))
    return out


_PROCESS_POOL: cf.ProcessPoolExecutor | None = None
_POOL_LOCK = threading.Lock()


def _process_pool() -> cf.ProcessPoolExecutor:
    # One long-lived pool: spawning interpreters per batch would cost seconds. 'spawn', because
    # forking a process that holds torch threads and an event loop is unsafe.
    global _PROCESS_POOL
    with _POOL_LOCK:
        if _PROCESS_POOL is None:
            _PROCESS_POOL = cf.ProcessPoolExecutor(max_workers=2, mp_context=mp.get_context("spawn"))
        return _PROCESS_POOL


async def score_groups_async(groups: list[RolloutGroup], specs: list[RewardSpec]) -> dict[str, float | None]:
    """Score every completion with every reward, concurrently; fills the completions in place."""
    t0 = time.perf_counter()
    inputs = _batch_inputs(groups)
    pools: dict[str, cf.Executor] = {}
    if any(s.executor == "process" for s in specs):
        pools["process"] = _process_pool()
    per_fn = await asyncio.gather(*(_run_one(s, inputs, pools) for s in specs))
    failpoint("score")
    _apply(groups, specs, per_fn)
    return _metrics(groups, specs, per_fn, time.perf_counter() - t0)


def score_groups(groups: list[RolloutGroup], specs: list[RewardSpec]) -> dict[str, float | None]:
    """Sync entry point; works inside a running event loop too (runs on a helper thread's loop)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(score_groups_async(groups, specs))
    with cf.ThreadPoolExecutor(max_workers=1) as ex:
        return ex.submit(asyncio.run, score_groups_async(groups, specs)).result()


@task(name="score-rollouts", cache_policy=NO_CACHE, retries=0)
def score_rollouts(groups: list[RolloutGroup], specs: list[RewardSpec]) -> dict[str, float | None]:
    """Prefect task: score groups in place (pass `quote(groups)` so Prefect doesn't walk them)."""
    return score_groups(groups, specs)

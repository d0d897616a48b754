"""The units of work of one training step, and their thin Prefect tasks.

Each function takes flat arguments and can be called directly (tests do); the `@task` wrappers at the
bottom add retries, timeouts and `NO_CACHE`. Big objects (groups, the learner) reach these tasks
wrapped in `quote(...)` so Prefect's argument walker never traverses token lists.
"""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from prefect import task
from prefect.cache_policies import NO_CACHE

from storage.checkpoints import CheckpointStore
from storage.faults import failpoint
from storage.records import RolloutGroup
from storage.rollouts import RolloutStore
from tasks.grpo import group_advantages
from tasks.imports import import_object
from tasks.push import DEFAULT_RELOAD_TIMEOUT_S


class VersionBox:
    """The policy version currently served by vLLM, shared between the pusher and generators."""

    def __init__(self, version: int = 0):
        self._v = version
        self._lock = threading.Lock()

    def get(self) -> int:
        with self._lock:
            return self._v

    def set(self, v: int) -> None:
        with self._lock:
            self._v = v


@dataclass
class RolloutBatch:
    """What one generate -> score unit hands to the trainer."""

    step: int
    groups: list[RolloutGroup]
    metrics: dict[str, float] = field(default_factory=dict)
    body_start: float = 0.0  # perf_counter at task-body start/end (Prefect overhead accounting)
    body_end: float = 0.0


def _tool_kwargs(tool_paths: list[str], environment_path: str | None, **rest) -> dict[str, Any]:
    return dict(
        tools=[import_object(p) for p in tool_paths] or None,
        environment_factory=import_object(environment_path) if environment_path else None,
        **rest,
    )


async def _rollout_async(
    step: int,
    rows,
    prompt_indices,
    *,
    url,
    tokenizer_path,
    gen,
    reward_specs,
    tools,
    versions: VersionBox,
    client_kwargs,
) -> RolloutBatch:
    from tasks.generate import generate_groups, load_tokenizer
    from tasks.inference import VLLMClient
    from tasks.score import score_groups_async

    t0 = time.perf_counter()
    async with VLLMClient(url, **client_kwargs) as client:
        groups = await generate_groups(
            rows,
            prompt_indices,
            backend=client,
            tokenizer=load_tokenizer(tokenizer_path),
            version_fn=versions.get,
            **gen,
            **_tool_kwargs(**tools),
        )
    t1 = time.perf_counter()
    metrics = await score_groups_async(groups, reward_specs)
    t2 = time.perf_counter()
    n = sum(len(g.completions) for g in groups)
    gen_tokens = sum(sum(c.completion_mask) for g in groups for c in g.completions)
    metrics.update(
        {
            "gen_seconds": t1 - t0,
            "score_seconds": t2 - t1,
            "gen/completions": float(n),
            "gen/tokens": float(gen_tokens),
            "gen/tokens_per_s": gen_tokens / (t1 - t0) if t1 > t0 else 0.0,
            "gen/truncated_frac": sum(c.truncated for g in groups for c in g.completions) / max(1, n),
            "gen/tool_calls": float(sum(len(c.tool_calls) for g in groups for c in g.completions)),
            "gen/tool_failures": float(
                sum(tc.failed for g in groups for c in g.completions for tc in c.tool_calls)
            ),
        }
    )
    return RolloutBatch(step, groups, metrics, t0, t2)


def rollout_batch_fn(step: int, rows, prompt_indices, **kwargs) -> RolloutBatch:
    """Generate the groups of one step on the vLLM server, then score them (one worker thread)."""
    return asyncio.run(_rollout_async(step, rows, prompt_indices, **kwargs))


def max_lag(max_staleness: int, sync_every: int) -> int:
    """The largest staleness the pipeline produces by construction: a batch is generated up to
    `max_staleness` steps ahead, under weights pushed up to `sync_every - 1` steps before that."""
    return max_staleness + sync_every - 1


def assign_advantages(
    groups: list[RolloutGroup],
    *,
    step: int,
    max_staleness: int,
    sync_every: int = 1,
    scale: str,
    filter_zero_std: bool,
) -> dict[str, float]:
    """Drop stale groups, compute masked advantages, and mark which completions are trained on.

    Staleness, here, in the `rollouts` table and in the metrics, is one number: training steps between
    the policy that generated a sample (its version = optimizer updates in those weights) and the
    policy being trained at `step`. Only what exceeds `max_lag` (a server restart, a late batch) drops."""
    fresh, stale, limit = [], 0, max_lag(max_staleness, sync_every)
    for g in groups:
        staleness = max(step - c.policy_version for c in g.completions) if g.completions else 0
        if staleness > limit:
            stale += 1
            for c in g.completions:
                c.trained, c.advantage = False, 0.0
                c.drop_reason = (
                    f"stale: generated under version {c.policy_version}, trained at step {step} "
                    f"(lag {staleness} > {limit})"
                )
        else:
            fresh.append(g)
    rewards = [[c.reward if c.reward_valid else None for c in g.completions] for g in fresh]
    valid = [[c.reward_valid for c in g.completions] for g in fresh]
    adv, mask, metrics = group_advantages(rewards, valid, scale=scale, filter_zero_std=filter_zero_std)
    for g, a_row, m_row in zip(fresh, adv, mask, strict=True):
        n_valid = sum(c.reward_valid for c in g.completions)
        for c, a, m in zip(g.completions, a_row, m_row, strict=True):
            c.advantage, c.trained = float(a), bool(m)
            if not m and c.drop_reason is None:
                if not c.reward_valid:
                    c.drop_reason = f"reward invalid: {c.invalid_reason}"
                elif n_valid < 2:
                    c.drop_reason = "group has fewer than 2 valid completions"
                else:
                    c.drop_reason = "group filtered (zero reward variance)"
    out = {f"adv/{k}": float(v) for k, v in metrics.items() if isinstance(v, int | float)}
    out["groups_dropped_stale"] = float(stale)
    out["staleness_max"] = float(
        max((step - c.policy_version for g in groups for c in g.completions), default=0)
    )
    out["staleness_mean"] = float(
        sum(step - c.policy_version for g in groups for c in g.completions)
        / max(1, sum(len(g.completions) for g in groups))
    )
    return out


def persist_step_fn(root: str, run_id: str, step: int, groups: list[RolloutGroup]) -> float:
    """Write the step's rollouts and rewards (atomic Parquet files); returns seconds."""
    t0 = time.perf_counter()
    store = RolloutStore(Path(root))
    store.write_rollouts(run_id, step, groups)
    store.write_rewards(run_id, step, groups)
    return time.perf_counter() - t0


def train_fn(learner, groups: list[RolloutGroup]) -> dict[str, float]:
    from tasks.learn import samples_from_groups

    failpoint("train")
    return learner.train_step(samples_from_groups(groups))


def push_fn(
    learner,
    *,
    url: str,
    root: str,
    run_id: str,
    version: int,
    keep_last: int,
    client_kwargs,
    versions: VersionBox | None = None,
    reload_timeout_s: float = DEFAULT_RELOAD_TIMEOUT_S,
) -> dict:
    """Push the learner's weights as `version`; `versions` flips to it between reload and resume."""
    from tasks.push import push_weights_sync

    return push_weights_sync(
        learner.model,
        version,
        url=url,
        root=root,
        run_id=run_id,
        keep_last=keep_last,
        reload_timeout_s=reload_timeout_s,
        on_reloaded=versions.set if versions is not None else None,
        **client_kwargs,
    )


def checkpoint_fn(learner, *, root: str, run_id: str, step: int, state: dict, keep: int) -> float:
    t0 = time.perf_counter()
    CheckpointStore(Path(root)).save(run_id, step, learner.save, state, keep_last=keep)
    failpoint("checkpoint_done")
    return time.perf_counter() - t0


rollout_batch = task(name="rollout-batch", cache_policy=NO_CACHE, retries=1, retry_delay_seconds=5)(
    rollout_batch_fn
)
persist_step = task(name="persist-step", cache_policy=NO_CACHE, retries=2, retry_delay_seconds=1)(
    persist_step_fn
)
train_on_batch = task(name="train-step", cache_policy=NO_CACHE)(train_fn)
push_weights = task(name="push-weights", cache_policy=NO_CACHE, retries=1, retry_delay_seconds=5)(push_fn)
save_checkpoint = task(name="checkpoint", cache_policy=NO_CACHE, retries=1)(checkpoint_fn)

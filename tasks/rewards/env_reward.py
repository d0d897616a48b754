"""An environment's own reward, as TRL's `environment_factory` has it: when the environment class has
`get_reward()`, it is a reward source of its own (`tools.environment_reward`, on by default).

The rollout calls `get_reward()` on its own instance once its last turn ends, before the instance goes
back to the pool (tasks/rollouts/multi_turn.py: `call_get_reward`, under `tools.tool_timeout_s`), and
keeps the outcome on the completion. Scoring turns each outcome into the cell of the reward that the
run's config names with `fn: ENVIRONMENT_REWARD` (flows/config.py: `environment_rewards` adds it), as
any reward's: a number is valid, None or NaN invalid, an exception, a non-number or a timeout failed;
never 0.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from dataclasses import dataclass
from typing import Any

from grpoflow.tasks.threads import in_daemon_thread

# The reward entry's `fn`: scoring reads the rollouts' outcomes instead of calling it.
ENVIRONMENT_REWARD = "grpoflow.tasks.rewards.env_reward:environment_reward"


def environment_reward(**_: Any) -> list[float]:
    """Stands for an environment's get_reward() in a reward entry; never called: scoring takes the
    outcome each rollout recorded (this module's doc)."""
    raise TypeError(
        f"{ENVIRONMENT_REWARD} is scored from each rollout's get_reward(), not called; "
        "it needs tools.environment with a get_reward() method"
    )


def has_reward(env_or_class: Any) -> bool:
    return callable(getattr(env_or_class, "get_reward", None))


@dataclass(frozen=True)
class EnvReward:
    """One rollout's get_reward(): what it returned (`value`, unchecked), or why nothing came back
    (`status` 'failed' or 'timeout', and `reason`)."""

    value: Any = None
    status: str | None = None
    reason: str = ""
    seconds: float = 0.0


async def call_get_reward(env: Any, timeout_s: float) -> EnvReward:
    """`env.get_reward()` (sync on a daemon thread, or async), cut off after `timeout_s`."""
    fn, t0 = env.get_reward, time.perf_counter()
    deadline = asyncio.timeout(timeout_s)
    try:
        async with deadline:
            value = await fn() if inspect.iscoroutinefunction(fn) else await in_daemon_thread(fn)
    except Exception as e:
        if isinstance(e, TimeoutError) and deadline.expired():
            return EnvReward(None, "timeout", f"get_reward() exceeded {timeout_s}s", time.perf_counter() - t0)
        return EnvReward(None, "failed", f"{type(e).__name__}: {e}", time.perf_counter() - t0)
    return EnvReward(value, seconds=time.perf_counter() - t0)

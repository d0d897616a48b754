"""The step's advantages (`assign_advantages`): stale groups dropped, GRPO's group advantages
(tasks/learner/grpo.py, pure math) computed over the rest, and each completion marked trained or not,
with the reason.
"""

from __future__ import annotations

from grpoflow.storage.records import RolloutGroup
from grpoflow.tasks.config.algorithm import AlgorithmConfig
from grpoflow.tasks.learner.grpo import group_advantages


def max_lag(max_staleness: int, sync_every: int) -> int:
    """The largest staleness the pipeline produces by construction: a batch is generated up to
    `max_staleness` steps ahead, under weights pushed up to `sync_every - 1` steps before that."""
    return max_staleness + sync_every - 1


def _reward_parts(g: RolloutGroup) -> list[list[tuple[float, float | None]]] | None:
    """Each completion's reward cells as (weight, own valid value or None), for the leave-one-out
    baseline to leave each function out separately; None when a completion's reward is not the sum of
    its cells (no cells recorded), and the totals serve."""
    if any(not c.reward_cells for c in g.completions):
        return None
    return [
        [(x.weight, x.value if x.status == "valid" else None) for x in c.reward_cells] for c in g.completions
    ]


def assign_advantages(
    groups: list[RolloutGroup],
    *,
    step: int,
    algorithm: AlgorithmConfig,
    sync_every: int = 1,
) -> dict[str, float]:
    """Drop stale groups, compute masked advantages, and mark which completions are trained on.

    Staleness, here, in the `rollouts` table and in the metrics, is one number: training steps between
    the policy that generated a sample (its version = training steps in those weights) and the
    policy being trained at `step`. Only what exceeds `max_lag` (a server restart, a late batch) drops."""
    fresh, stale = _drop_stale(groups, step, max_lag(algorithm.max_staleness, sync_every))
    rewards = [[c.reward if c.reward_valid else None for c in g.completions] for g in fresh]
    valid = [[c.reward_valid for c in g.completions] for g in fresh]
    parts = [_reward_parts(g) for g in fresh]
    adv, mask, metrics = group_advantages(
        rewards,
        valid,
        scale=algorithm.scale,
        baseline=algorithm.baseline,
        parts=parts,
        filter_zero_std=algorithm.filter_zero_std,
    )
    truncated = _mark_trained(fresh, adv, mask, algorithm.mask_truncated)
    out = {f"adv/{k}": float(v) for k, v in metrics.items() if isinstance(v, int | float)}
    out["groups_dropped_stale"] = float(stale)
    if algorithm.mask_truncated:
        out["adv/truncated_masked"] = float(truncated)
    out["staleness_max"] = float(
        max((step - c.policy_version for g in groups for c in g.completions), default=0)
    )
    out["staleness_mean"] = float(
        sum(step - c.policy_version for g in groups for c in g.completions)
        / max(1, sum(len(g.completions) for g in groups))
    )
    return out


def _drop_stale(groups: list[RolloutGroup], step: int, limit: int) -> tuple[list[RolloutGroup], int]:
    """The groups trained on at `step`, and how many were dropped as staler than `limit`; every
    completion of a dropped group (stale, or left out by dynamic sampling) is marked untrained."""
    fresh, stale = [], 0
    for g in groups:
        staleness = max(step - c.policy_version for c in g.completions) if g.completions else 0
        if g.dropped is not None:  # dynamic sampling left it out of the step
            for c in g.completions:
                c.trained, c.advantage, c.drop_reason = False, 0.0, g.dropped
        elif staleness > limit:
            stale += 1
            for c in g.completions:
                c.trained, c.advantage = False, 0.0
                c.drop_reason = (
                    f"stale: generated under version {c.policy_version}, trained at step {step} "
                    f"(lag {staleness} > {limit})"
                )
        else:
            fresh.append(g)
    return fresh, stale


def _mark_trained(fresh: list[RolloutGroup], adv, mask, mask_truncated: bool) -> int:
    """Each completion's advantage, whether it is trained on, and why not; the truncated completions
    `mask_truncated` took out of the loss."""
    truncated = 0
    for g, a_row, m_row in zip(fresh, adv, mask, strict=True):
        n_valid = sum(c.reward_valid for c in g.completions)
        for c, a, m in zip(g.completions, a_row, m_row, strict=True):
            if m and c.truncated and mask_truncated:
                # DAPO's overlong filtering: its reward stays in the group's baseline, its tokens out of the loss
                m, truncated = False, truncated + 1
                c.drop_reason = "truncated at the token budget (algorithm.mask_truncated)"
            c.advantage, c.trained = float(a), bool(m)
            if not m and c.drop_reason is None:
                if not c.reward_valid:
                    c.drop_reason = f"reward invalid: {c.invalid_reason}"
                elif n_valid < 2:
                    c.drop_reason = "group has fewer than 2 valid completions"
                else:
                    c.drop_reason = "group filtered (zero reward variance)"
    return truncated

"""Whether a group's rewards can teach anything: the one test that both sampling (DAPO's dynamic
sampling keeps the groups that have signal, tasks/rollouts/sampling.py) and the loss (a group with zero
std gets advantages of exactly 0, tasks/learner/grpo.py) apply. Pure: lists of floats in, no torch.

It lives here, beside the subsystems rather than in one of them, so that rollouts and the learner both
read it without either importing the other.
"""

from __future__ import annotations

import statistics

# A group's rewards count as all equal when their std is within this fraction of their magnitude:
# rewards computed by float arithmetic differ in their last bits (0.1 + 0.2 vs 0.3: a std of ~3e-17),
# which `std == 0` misses and `group` scaling would blow up into advantages of ~1e-13 that no longer
# compare equal to 0.
ZERO_STD_RTOL = 1e-6


def reward_std(xs: list[float]) -> float:
    # Unbiased (n-1) std, like torch.std and TRL: with G=2 the population std halves the signal's scale.
    return statistics.stdev(xs) if len(xs) > 1 else 0.0


def is_flat(xs: list[float], std: float) -> bool:
    """Whether rewards with this std are all equal, up to float noise (ZERO_STD_RTOL)."""
    return std <= ZERO_STD_RTOL * max(1.0, max(abs(x) for x in xs))


def has_signal(valid_rewards: list[float]) -> bool:
    """Whether a group's valid rewards can teach anything: at least two, not all equal (the same test
    as `group_advantages`' zero std). DAPO's dynamic sampling keeps the groups that have it."""
    return len(valid_rewards) >= 2 and not is_flat(valid_rewards, reward_std(valid_rewards))

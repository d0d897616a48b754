"""DAPO's dynamic sampling (Yu et al. 2025, "DAPO: an open-source LLM reinforcement learning system at
scale", section 3.2): a step keeps generating further prompts until it holds `prompts_per_step` groups
whose valid rewards differ, since a group whose samples all score the same has zero advantage and
teaches nothing.

The data cursor stays a pure function of the step: round 0 is the step's own rows (flows/training/data.py:
rows_for_step); round r > 0 draws rows from a stream seeded by (seed, step, r), and its groups get prompt
indices in a space of their own (`EXTRA_BASE` + ...), so their sampling seeds and group ids never meet a
cursor position, and a resume that redoes the step draws the same rows.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Any

from grpoflow.storage.records import RolloutGroup
from grpoflow.tasks.group_signal import has_signal

EXTRA_BASE = 1_000_000_000  # prompt indices of further rounds' groups start here (cursor positions never do)
MAX_ROUNDS = 128  # rounds per step the index space holds (AlgorithmConfig.max_sampling_rounds <= 100)
NO_SIGNAL = "dynamic sampling: zero reward variance"
STEP_FULL = "dynamic sampling: the step already holds data.prompts_per_step groups"


@dataclass
class DynamicSampling:
    """Where a step's further prompts come from: the training rows, the step's size, the run's seed."""

    rows: list[dict[str, Any]]
    per_step: int
    seed: int | None
    max_rounds: int

    def round_rows(self, step: int, rnd: int, k: int) -> tuple[list[dict[str, Any]], list[int]]:
        """`k` rows for round `rnd` (>= 1) of `step` and their prompt indices: a pure function of
        (seed, step, round)."""
        rng = random.Random(f"grpoflow-dynamic-sampling/{self.seed}/{step}/{rnd}")
        n = len(self.rows)
        picks = rng.sample(range(n), k) if k <= n else [rng.randrange(n) for _ in range(k)]
        base = EXTRA_BASE + (step * MAX_ROUNDS + rnd) * self.per_step * 4
        return [self.rows[i] for i in picks], [base + j for j in range(k)]

    def next_round_size(self, kept: int, generated: int) -> int:
        """How many prompts the next round generates: enough for the groups still missing at the share
        with signal seen so far (a step's worth when none had it), at most four steps' worth."""
        missing = self.per_step - kept
        rate = kept / generated if generated and kept else 1.0 / self.per_step
        return max(1, min(self.per_step * 4, math.ceil(missing / rate)))


def with_signal(g: RolloutGroup) -> bool:
    return has_signal([c.reward for c in g.completions if c.reward_valid and c.reward is not None])


def select(groups: list[RolloutGroup], per_step: int) -> int:
    """Mark for dropping the groups the step does not train on: those without reward variance, and those
    with it beyond the first `per_step` (in generation order: round, then position). Returns how many
    groups with signal it keeps."""
    kept = 0
    for g in groups:
        if not with_signal(g):
            g.dropped = NO_SIGNAL
        elif kept >= per_step:
            g.dropped = STEP_FULL
        else:
            g.dropped = None
            kept += 1
    return kept

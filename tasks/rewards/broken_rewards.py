"""A reward broken on a whole batch: it failed (raised, timed out, returned the wrong number of values)
on every completion, which is a bug in the function or its config, not data to mask. `broken_rewards` names
each one with its first traceback and, where the completions' form looks like the cause, what to set; the flow
stops a run on a required one (`BrokenRewardError`, flows/training/step_close.py: RewardWatch).

A batch masked whole (`masked_batch`): no completion has a valid value of every required reward, whatever the
cells say (invalid, failed, timed out), so the step trains on nothing; the same watch stops a run that keeps
doing so. A batch whose groups all had equal rewards is not one: its rewards are valid, its advantages 0."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from grpoflow.storage.records import RolloutGroup
from grpoflow.tasks.config.rewards import RewardConfig
from grpoflow.tasks.rewards.reward_kwargs import is_conversational


@dataclass(frozen=True)
class BrokenReward:
    """A reward that failed (raised, timed out, returned the wrong number of values) on every
    completion of a batch: a bug in the function or its config, not data to mask."""

    index: int  # its place in `rewards`
    name: str
    required: bool
    failed: int
    total: int
    reason: str  # the first cell's
    trace: str | None  # the first traceback, when the function raised
    hint: str | None  # what to change, when the failure looks like the completions' form

    def line(self) -> str:
        kind = "" if self.required else " (optional: imputed)"
        out = f"reward {self.name!r}{kind} failed on {self.failed}/{self.total} completions: {self.reason}"
        return f"{out}; {self.hint}" if self.hint else out


class BrokenRewardError(RuntimeError):
    """A required reward failed on every completion of `run.max_failed_reward_steps` steps in a row:
    the run stops (resumable) rather than train on nothing."""


@dataclass(frozen=True)
class MaskedBatch:
    """Every completion of a batch masked out of the loss: no valid value of every required reward."""

    total: int  # completions
    causes: tuple[str, ...]  # per required reward with cells that are not valid: counts and first reason

    def line(self) -> str:
        return f"every completion ({self.total}) was masked: {'; '.join(self.causes)}"


_FORMAT_ERRORS = ("TypeError:", "KeyError:")


def broken_rewards(groups: list[RolloutGroup], specs: list[RewardConfig]) -> list[BrokenReward]:
    """The rewards that failed on every completion of `groups` (scored). A TypeError or KeyError from a
    text-form reward while the prompts are conversational reads as TRL code indexing a completion as
    messages: its hint says to set `completions: messages`."""
    comps = [c for g in groups for c in g.completions]
    conversational = any(is_conversational(g.prompt_input_of(c)) for g in groups for c in g.completions)
    out = []
    for i, spec in enumerate(specs):
        cells = [x for c in comps for x in c.reward_cells if x.name == spec.name and x.applies]
        if not cells or any(x.status not in ("failed", "timeout") for x in cells):
            continue
        first = cells[0]
        hint = None
        if conversational and spec.completions == "text" and first.reason.startswith(_FORMAT_ERRORS):
            hint = (
                f"the prompts are conversational: if the function reads completions as messages "
                f"(TRL's form), set rewards[{i}].completions: messages"
            )
        out.append(
            BrokenReward(i, spec.name, spec.required, len(cells), len(cells), first.reason, first.trace, hint)
        )
    return out


def masked_batch(groups: list[RolloutGroup], specs: list[RewardConfig]) -> MaskedBatch | None:
    """`groups` (scored) when not one completion counts in the loss for want of valid rewards: each
    required reward's cells that are not valid, by status, with the first one's reason."""
    comps = [c for g in groups for c in g.completions]
    if not comps or any(c.reward_valid for c in comps):
        return None
    causes = []
    for spec in (s for s in specs if s.required):
        bad = [
            x
            for c in comps
            for x in c.reward_cells
            if x.name == spec.name and x.status != "valid" and x.applies
        ]
        if bad:
            counts = Counter(x.status for x in bad)
            how = ", ".join(f"{status} on {n}/{len(comps)}" for status, n in counts.items())
            causes.append(f"reward {spec.name!r} {how}: {bad[0].reason}")
    return MaskedBatch(len(comps), tuple(causes))

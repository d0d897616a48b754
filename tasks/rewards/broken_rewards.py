"""A reward broken on a whole batch: it failed (raised, timed out, returned the wrong number of values)
on every completion, which is a bug in the function or its config, not data to mask. `broken_rewards` names
each one with its first traceback and, where the completions' form looks like the cause, what to set; the flow
stops a run on a required one (`BrokenRewardError`, flows/training/step_close.py: RewardWatch)."""

from __future__ import annotations

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


_FORMAT_ERRORS = ("TypeError:", "KeyError:")


def broken_rewards(groups: list[RolloutGroup], specs: list[RewardConfig]) -> list[BrokenReward]:
    """The rewards that failed on every completion of `groups` (scored). A TypeError or KeyError from a
    text-form reward while the prompts are conversational reads as TRL code indexing a completion as
    messages: its hint says to set `completions: messages`."""
    comps = [c for g in groups for c in g.completions]
    conversational = any(is_conversational(g.prompt_input_of(c)) for g in groups for c in g.completions)
    out = []
    for i, spec in enumerate(specs):
        cells = [x for c in comps for x in c.reward_cells if x.name == spec.name]
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

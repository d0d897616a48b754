"""What is a + b? One turn; `correct` when the reply holds the sum, `odd_only` scored on odd tasks only."""

import asyncio
from collections import Counter

import verifiers.v1 as vf
from pydantic import Field


class SumData(vf.TaskData):
    answer: int


class SumTaskConfig(vf.TaskConfig):
    explode: bool = False
    """Every episode's setup raises: an environment that fails on every episode."""
    hang_on: list[int] = Field(default_factory=list)
    """The tasks (idx) whose episodes hang in setup: a hung environment."""
    explode_first: str = ""
    """A key: the first episode of each task to start under it raises in its setup (a group with one
    episode that made no model turn beside others that did). A key of its own per test: the count lives
    in the process, which other tests' episodes share."""


_STARTED: Counter = Counter()  # episodes started, per (explode_first key, task)


class SumTask(vf.Task[SumData, vf.State, SumTaskConfig]):
    async def setup(self, trace: vf.Trace, runtime) -> None:
        if self.config.explode:
            raise RuntimeError("vf_sum: explode is set")
        key = (self.config.explode_first, self.data.idx)
        _STARTED[key] += 1
        if self.config.explode_first and _STARTED[key] == 1:
            raise RuntimeError("vf_sum: the first episode of the task explodes")
        if self.data.idx in self.config.hang_on:
            await asyncio.sleep(3600)

    @vf.reward
    async def correct(self, trace: vf.Trace) -> float:
        return float(str(self.data.answer) in (trace.last_reply or ""))

    @vf.reward(weight=0.5)
    async def odd_only(self, trace: vf.Trace) -> float | None:
        """Not computed (None) on even tasks: a cell grpoflow must mask, never score 0."""
        return 1.0 if self.data.idx % 2 else None

    @vf.metric
    async def reply_chars(self, trace: vf.Trace) -> float:
        return float(len(trace.last_reply or ""))


class SumConfig(vf.TasksetConfig):
    num_tasks: int = 8
    task: SumTaskConfig = SumTaskConfig()


class SumTaskset(vf.Taskset[SumTask, SumConfig]):
    def load(self) -> list[SumTask]:
        return [
            SumTask(SumData(idx=i, prompt=f"What is {i} + {i + 1}?", answer=2 * i + 1), self.config.task)
            for i in range(self.config.num_tasks)
        ]


async def manners(trace: vf.Trace) -> dict[str, float]:
    """Keyed scores, as verifiers' reward decorator documents them: verifiers records `polite` and `brief`
    as rewards of their own, each with this function's weight, and no reward named `manners`. Plugged by
    a config (`task.rewards.manners.fn`), so the taskset's own rewards stay as they are without it."""
    reply = trace.last_reply or ""
    return {"polite": float("please" in reply.lower()), "brief": 1.0 / (1.0 + len(reply))}

"""A step's figures as one typed record (`StepRecord`, with its clock `StepTimes`): the `steps` row,
the progress artifact and the step's log line are read from it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from grpoflow.tasks.push.push import PushStats


@dataclass
class StepTimes:
    """Where a step's wall time went, in seconds."""

    wall: float = 0.0  # since the previous step ended (its row write and report are in this step)
    wait: float = 0.0  # the learner idling for generation
    settle: float | None = None  # run.reproducible: a push waiting for the batches generated ahead
    write: float = 0.0  # the step's rollouts and rewards, beside the update
    prefect: float = 0.0  # Prefect's task runs on the step's critical path
    checkpoint: float | None = None  # a checkpoint's save, when one was due
    eval: float | None = None  # the held-out split scored after the step (run.eval_every): not in `wall`


@dataclass
class StepRecord:
    """One step's figures, each part filled by the unit that measured it; `row()` is the `steps`
    table's row (and what the progress artifact and trackers read)."""

    step: int
    rollout: dict[str, float] = field(default_factory=dict)  # gen/, reward/, server health: the batch's
    advantages: dict[str, float] = field(default_factory=dict)  # adv/, staleness: assign_advantages
    train: dict[str, float] = field(default_factory=dict)  # train/: the learner's
    push: PushStats | None = None  # when the step pushed
    policy_version: int = 0  # what the servers serve once the step is done
    server_restarts: int = 0
    eval: dict[str, float] = field(default_factory=dict)  # eval/: the held-out split, when it was scored
    times: StepTimes = field(default_factory=StepTimes)

    def row(self) -> dict[str, float]:
        t = self.times
        out = self.rollout | self.advantages | self.train | {"write_seconds": t.write}
        if self.push is not None:
            out |= self.push.metrics()
        out |= {
            "sync_seconds": self.push.total_seconds if self.push is not None else 0.0,
            "policy_version": self.policy_version,
            "server_restarts": self.server_restarts,
            "wall_seconds": t.wall,
            "wait_seconds": t.wait,
            "prefect_overhead_seconds": t.prefect,
            "prefect_overhead_frac": t.prefect / t.wall if t.wall > 0 else 0.0,
        }
        if t.checkpoint is not None:
            out["checkpoint_seconds"] = t.checkpoint
        if t.settle is not None:
            out["settle_seconds"] = t.settle
        if t.eval is not None:
            out |= self.eval | {"eval_seconds": t.eval}
        return out

    def summary(self) -> str:
        """What the learner's side of the step did, in one line (the train-step task run's log)."""
        m = self.train
        parts = [
            f"wrote rollouts + rewards in {self.times.write:.2f}s",
            f"trained {m.get('train/samples', 0):.0f} samples in {m.get('train/seconds', 0):.2f}s",
        ]
        if self.push is not None:
            parts.append(f"pushed version {self.push.version} in {self.push.total_seconds:.2f}s")
        return "; ".join(parts)

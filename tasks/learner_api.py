"""What a run asks of its learner: the in-process `tasks.learn.Learner`, the sharded
`tasks.distributed.DistributedLearner`, and any later variant (e.g. one training a LoRA adapter) alike.

Imports nothing heavy: flows and weight-push backends type against it without loading torch.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from tasks.learn import TrainSample


class PolicyLearner(Protocol):
    """The policy being trained, its optimizer and schedule, as the training loop drives them."""

    def train_step(self, samples: list[TrainSample]) -> dict[str, float]:
        """Update on one generation batch; the steps table's train/ metrics."""
        ...

    def write_weights(self, directory: Path) -> None:
        """What the inference servers load: a model dir (weights + config.json) in `directory`."""
        ...

    def save(self, directory: Path) -> None:
        """A resumable checkpoint: a complete model dir, the optimizer, schedule and RNG state."""
        ...

    def load_trainer_state(self, directory: Path) -> None:
        """Restore optimizer, schedule and RNG from a checkpoint `save` wrote (the weights come from
        building the learner on its model dir)."""
        ...

    def close(self) -> None:
        """Release what the learner holds outside this process (a sharded learner's ranks)."""
        ...

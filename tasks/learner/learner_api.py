"""What a run asks of its learner, what it tells one beside its config sections, and what it trains on
(`TrainSample`, made from the rollout groups by `samples_from_groups`).

`PolicyLearner` is the in-process `tasks.learn.Learner` (full fine-tuning or a LoRA adapter) and the
sharded `tasks.distributed.DistributedLearner` alike. Imports nothing heavy: flows and weight-push
backends type against it without loading torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from grpoflow.storage.records import RolloutGroup


# What a learner's checkpoint dir holds beside its optimizer and state: a full fine-tuning learner's
# model dir, or a LoRA learner's adapter (PEFT format; its learner.json names the base model).
MODEL_DIR = "model"
ADAPTER_DIR = "adapter"


def checkpoint_weights(directory: Path) -> Path:
    """What a learner's checkpoint dir holds for the servers: its `adapter/` (LoRA) or its `model/`."""
    adapter = Path(directory) / ADAPTER_DIR
    return adapter if adapter.is_dir() else Path(directory) / MODEL_DIR


@dataclass
class TrainSample:
    """One completion ready for the loss: prompt + completion tokens and aligned masks."""

    input_ids: list[int]  # [P + T]
    prompt_len: int  # P
    completion_mask: list[int]  # [T]
    behaviour_logprobs: list[float]  # [T]
    advantage: float


def samples_from_groups(groups: list[RolloutGroup]) -> list[TrainSample]:
    """Completions marked `trained` (valid, fresh, in a group with signal), in batch order."""
    out = []
    for g in groups:
        for c in g.completions:
            if not c.trained or not any(c.completion_mask):
                continue
            prompt_ids = g.prompt_ids_of(c)  # its own prompt: reset notes may differ per sample
            out.append(
                TrainSample(
                    input_ids=list(prompt_ids) + list(c.completion_ids),
                    prompt_len=len(prompt_ids),
                    completion_mask=list(c.completion_mask),
                    behaviour_logprobs=list(c.logprobs),
                    advantage=float(c.advantage),
                )
            )
    return out


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


@dataclass(frozen=True)
class LearnerRun:
    """What a learner takes from its run rather than from a config section."""

    total_steps: int  # training steps of the run: the LR schedule's length
    seed: int = 0  # torch's seed before the model loads
    ref_model_path: str | Path | None = None  # the frozen reference (algorithm.beta > 0); None: the model's
    tokenizer_path: str | Path | None = None  # saved into checkpoints; None: the model dir's
    adapter_path: str | Path | None = None  # learner.lora: the adapter to continue (a checkpoint's)

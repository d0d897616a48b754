"""The `rewards` entries: one `RewardConfig` per reward function or reward model, as scoring reads it."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator
from pydantic.json_schema import SkipJsonSchema

from grpoflow.tasks.config.choices import Device
from grpoflow.tasks.config.section import Section, check_import_path_syntax, check_sendable


class RewardConfig(Section):
    name: str = Field(..., min_length=1, description="Name of the reward in tables and metrics.")
    fn: str | SkipJsonSchema[Callable[..., Any]] | None = Field(
        None,
        description="Import path 'module:function' of the reward function (from Python also the "
        "callable itself, e.g. an nn.Module reward model). Set `fn` or `model`.",
    )
    model: str | None = Field(
        None,
        description="A reward model instead of `fn`: a local directory holding an "
        "AutoModelForSequenceClassification and its tokenizer. It scores prompt + completion (through "
        "its own chat template when the prompts are conversational), logit 0 per completion; loaded "
        "once per run.",
    )
    batch_size: int = Field(8, ge=1, description="Completions per forward pass of a reward `model`.")
    device: Device = Field(
        "auto", description="Where a reward `model` runs: auto = cuda when available, else cpu."
    )
    completions: Literal["text", "messages"] = Field(
        "text",
        description="How `completions` and `prompts` reach the function. text: the completion's text. "
        "messages: as TRL passes them: for a conversational prompt, the completion's messages (the "
        "assistant message; with tools every message after the prompt: assistant turns with their "
        "`tool_calls`, tool results) and the prompt as its message list; plain-text prompts stay text.",
    )
    weight: float = Field(1.0, description="Weight in the total reward.")
    timeout_s: float = Field(30.0, gt=0, description="Per-batch timeout; over it the cells are 'timeout'.")
    executor: Literal["thread", "process", "ray"] = Field(
        "thread",
        description="Where sync functions run: thread pool, process pool (CPU-bound), or Ray tasks on the "
        "cluster of scale.ray_address (`environments` arrive as None in a process or on Ray; async "
        "functions always run locally).",
    )
    num_cpus: float = Field(1.0, gt=0, description="CPUs one call reserves on Ray (executor: ray).")
    required: bool = Field(
        True,
        description="If not valid, the completion is masked out of the loss. An optional reward "
        "(false) that is invalid, failed or timed out counts as the mean of its valid values in the "
        "same group, over completions whose required rewards are valid (nothing if there are none), "
        "so it neither helps nor hurts the completion's advantage; the cell keeps its status and "
        "reason and is marked `imputed`.",
    )
    kwargs: dict[str, Any] = Field(default_factory=dict, description="Extra keyword arguments.")

    @field_validator("fn")
    @classmethod
    def _import_path(cls, v: Any) -> Any:
        return check_import_path_syntax(v) if isinstance(v, str) else v

    @model_validator(mode="after")
    def _fn_or_model(self) -> RewardConfig:
        if (self.fn is None) == (self.model is None):
            raise ValueError(
                f"reward {self.name!r}: set exactly one of fn (a function) and model (a reward model)"
            )
        if self.model is not None and self.executor != "thread":
            raise ValueError(f"reward {self.name!r}: a reward model runs in this process (executor 'thread')")
        check_sendable(self.fn, f"reward {self.name!r}", self.executor)
        return self

"""What the learner optimises: the `algorithm` section (the RL objective: loss, advantages, off-policy
correction, staleness) and the `warmup` section (supervised fine-tuning before RL)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from pydantic import Field, field_validator, model_validator
from pydantic.json_schema import SkipJsonSchema

from grpoflow.tasks.config.choices import Baseline, Correction, LossType, Scale
from grpoflow.tasks.config.section import Section, check_import_path_syntax


class WarmupConfig(Section):
    """Supervised fine-tuning before RL, for a model that never does what the reward needs (a model
    that never writes a tool call gets no tool-call signal to learn from). Run once per model and
    settings, cached under the store root; keep it short of saturation so RL has room to improve."""

    examples: str | SkipJsonSchema[Callable[..., Any]] | None = Field(
        None,
        description="'module:function' returning SFT examples: rows with 'prompt' (as data rows) and "
        "'reply' (the assistant's text, or the messages that follow the prompt: assistant turns are "
        "learned, tool turns are context). Prompts get the tools exactly as rollouts do.",
    )
    examples_kwargs: dict[str, Any] = Field(default_factory=dict, description="Keyword arguments for it.")
    steps: int = Field(0, ge=0, description="SFT optimizer steps (0 = no warm-up).")
    batch_size: int = Field(8, ge=1, description="Examples per SFT step.")
    lr: float = Field(1e-4, gt=0, description="SFT learning rate (AdamW, constant).")

    @field_validator("examples")
    @classmethod
    def _import_path(cls, v: Any) -> Any:
        return check_import_path_syntax(v) if isinstance(v, str) else v

    @model_validator(mode="after")
    def _examples_when_steps(self) -> WarmupConfig:
        if self.steps and self.examples is None:
            raise ValueError(f"warmup.steps is {self.steps} but warmup.examples is not set")
        return self


class AlgorithmConfig(Section):
    loss_type: LossType = Field(
        "grpo",
        description="Loss variant.",
        json_schema_extra={
            "choices": {
                "grpo": "PPO-clipped token ratio; each sequence's token mean, then the mean over "
                "sequences (GRPO, DeepSeekMath, arXiv 2402.03300).",
                "dr_grpo": "Token sum / (sequences x max completion length): no length bias (Dr. GRPO, "
                "arXiv 2503.20783; pair with scale: none).",
                "dapo": "Token sum / tokens in the batch (DAPO, arXiv 2503.14476, which clips at epsilon "
                "0.2, epsilon_high 0.28).",
                "gspo": "One ratio per sequence, the geometric mean of its token ratios, clipped per "
                "sequence (GSPO, arXiv 2507.18071: epsilon 3e-4, epsilon_high 4e-4); differs from grpo "
                "only when the ratio is not 1 (num_iterations or mini_batches > 1).",
                "cispo": "The ratio, clipped to [1 - epsilon, 1 + epsilon_high] and detached, weights "
                "every token's log-probability: no token loses its gradient; token sum / tokens "
                "(CISPO, MiniMax-M1, arXiv 2506.13585, which sets no lower bound (epsilon >= 1) and "
                "tunes only the upper one; Tinker ships a cap of 4, epsilon_high 3.0).",
            }
        },
    )
    epsilon: float = Field(0.2, gt=0, description="Lower clip range of the ratio: clipped below 1 - epsilon.")
    epsilon_high: float | None = Field(
        None, gt=0, description="Upper clip range: clipped above 1 + epsilon_high (None: epsilon)."
    )
    beta: float = Field(0.0, ge=0, description="KL coefficient to the reference model (k3); 0 = none.")
    baseline: Baseline = Field(
        "group_mean",
        description="What a sample's reward is compared with. Invalid samples never enter a baseline; a "
        "group with fewer than 2 valid samples trains nothing.",
        json_schema_extra={
            "choices": {
                "group_mean": "The mean of the group's valid rewards (GRPO).",
                "leave_one_out": "The mean of the other valid rewards of the group: G/(G-1) x (r - mean) "
                "(RLOO, arXiv 2402.14740, as TRL's RLOOTrainer). An optional reward's imputed value never "
                "enters another sample's baseline: each reward is left out per function. `scale` then "
                "divides as it does for group_mean; scale: none is the paper's RLOO.",
            }
        },
    )
    scale: Scale = Field(
        "group",
        description="Advantage std scaling.",
        json_schema_extra={
            "choices": {
                "group": "Divide by the group's reward std (+1e-4) (GRPO).",
                "batch": "Divide by the std of every valid reward of the batch (TRL's scale_rewards batch).",
                "none": "No division (Dr. GRPO; RLOO).",
            }
        },
    )
    filter_zero_std: bool = Field(False, description="Drop groups whose valid rewards are all equal.")
    dynamic_sampling: bool = Field(
        False,
        description="DAPO's dynamic sampling (Yu et al. 2025): a step keeps generating further prompts "
        "until it holds data.prompts_per_step groups whose valid rewards differ (at most "
        "max_sampling_rounds rounds, then it trains on what it has). Groups without reward variance, and "
        "those beyond prompts_per_step, land in the store with their drop reason; the data cursor "
        "stays a function of the step (further prompts come from a stream seeded by (seed, step, round)).",
    )
    max_sampling_rounds: int = Field(
        3,
        ge=1,
        le=100,
        description="With dynamic_sampling: generation rounds per step at most, the first included.",
    )
    mask_truncated: bool = Field(
        False,
        description="DAPO's overlong filtering: completions cut at the token budget are left out of the "
        "loss (their reward still counts in the group's baseline); drop reason recorded.",
    )
    num_iterations: int = Field(
        1,
        ge=1,
        description="Passes over each generation batch (PPO epochs; TRL's num_iterations). Old "
        "log-probabilities are taken once per batch, before its first update, so the ratio, the clip and "
        "GSPO's sequence ratio act from the second update on. Optimizer steps per batch = num_iterations "
        "x learner.mini_batches; with 1 no extra forward pass runs.",
    )
    correction: Correction = Field(
        "tis",
        description="Off-policy correction of the learner's old policy against vLLM's behaviour "
        "logprobs (sampler mismatch and staleness).",
        json_schema_extra={
            "choices": {
                "none": "No correction.",
                "tis": "Each token weighted by its ratio, truncated at correction_cap (truncated "
                "importance sampling, Yao et al. 2025; TRL's token_truncate).",
                "icepop": "Tokens whose ratio lies outside [correction_low, correction_high] are dropped, "
                "the others weighted by it (IcePop, Ling team 2025).",
                "seq_mask": "A sequence is dropped when the geometric mean of its token ratios lies "
                "outside [correction_low, correction_high] (TRL's sequence_mask; SkyRL's geometric "
                "mask).",
                "seq_tis": "Every token of a sequence is weighted by the geometric mean of its token "
                "ratios, truncated at correction_cap (sequence-level truncation as TRL and SkyRL ship it, "
                "on the geometric mean so that length does not decide).",
            }
        },
    )
    correction_cap: float = Field(2.0, gt=1, description="Truncation cap of the tis and seq_tis weights.")
    correction_low: float | None = Field(
        None,
        ge=0,
        lt=1,
        description="Lower bound of the band icepop and seq_mask keep (None: 1 / correction_cap; 0: none).",
    )
    correction_high: float | None = Field(
        None, gt=1, description="Upper bound of the band icepop and seq_mask keep (None: correction_cap)."
    )
    max_staleness: int = Field(
        1,
        ge=0,
        description="Batches generated ahead of training; 0 = synchronous on-policy (needs "
        "sync.sync_every 1). A sample's staleness is the number of training steps between the policy "
        "that generated it and the policy trained on it; the pipeline keeps it at most max_staleness + "
        "sync.sync_every - 1, and a group staler than that (e.g. delayed by a server restart) is "
        "dropped, stored with its reason.",
    )

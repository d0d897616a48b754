"""The `learner` section (optimisation, device, micro-batching, ranks) and its `lora` adapter."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from grpoflow.tasks.config.choices import Device
from grpoflow.tasks.config.section import Section

# The projections of a Llama/Qwen/Mistral-style decoder's attention and MLP blocks.
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# The adapter ranks vLLM serves (its --max-lora-rank takes one of these).
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


class LoraConfig(Section):
    """A LoRA adapter trained instead of the whole model (peft); the base model stays frozen."""

    rank: int = Field(16, ge=1, le=VLLM_LORA_RANKS[-1], description="Adapter rank r (vLLM serves up to 512).")
    alpha: float = Field(32.0, gt=0, description="LoRA alpha: the update is scaled by alpha / rank.")
    dropout: float = Field(
        0.0,
        ge=0,
        lt=1,
        description="Dropout on the adapter's input while training (0: the learner's logprobs are "
        "deterministic, as the importance ratio assumes).",
    )
    target_modules: list[str] = Field(
        default_factory=lambda: list(LORA_TARGETS),
        min_length=1,
        description="Module names (suffixes, as peft matches them) that get an adapter; default: the "
        "attention and MLP projections. Each must name a linear layer of the model.",
    )

    def served_rank(self) -> int:
        """The smallest rank vLLM's --max-lora-rank takes that holds this adapter."""
        return next(r for r in VLLM_LORA_RANKS if r >= self.rank)


class LearnerConfig(Section):
    lr: float = Field(1e-5, gt=0, description="Peak learning rate (AdamW).")
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay.")
    warmup_steps: int = Field(0, ge=0, description="Linear warm-up, in optimizer steps.")
    lr_schedule: Literal["constant", "linear", "cosine"] = Field("constant", description="LR decay.")
    micro_batch_size: int = Field(
        16,
        ge=1,
        description="Sequences per forward/backward (grad accum; the update is the same sum). Larger is "
        "faster where memory allows: on a 2-core CPU, a SmolLM2-135M step of the demo's 64 sequences ran "
        "1.4x as fast in one micro-batch as in four of 16.",
    )
    mini_batches: int = Field(
        1,
        ge=1,
        description="Optimizer steps per pass over a generation batch: its trained samples are split, in "
        "batch order, into this many near-equal parts (TRL's steps_per_generation). Each part's loss is "
        "normalised over that part. The LR schedule and warmup_steps count optimizer steps.",
    )
    max_grad_norm: float = Field(1.0, gt=0, description="Gradient clipping norm.")
    gradient_checkpointing: bool = Field(False, description="Trade compute for activation memory.")
    compile: bool = Field(
        False,
        description="torch.compile each decoder layer (the first step compiles them; the shared prompt "
        "is then off). On one H200, 1.5B full fine-tuning: 1.47 s a step eager, 1.08-1.10 s compiled (30% "
        "-> 41% MFU). Off by default: compiling takes a while and rarely pays on a CPU.",
    )
    lm_head_chunk: int | None = Field(
        None,
        ge=1,
        description="Run the LM head on this many positions at a time and recompute each chunk's float32 "
        "logits in the backward, so the [tokens, vocab] logits (a step's largest tensor at a 150k "
        "vocabulary) never exist whole; the same logprobs and gradients. Llama, Mistral, Qwen2/3 and "
        "Gemma 3 models, one learner rank. None: the whole micro-batch's logits at once.",
    )
    device: Device = Field("auto", description="Learner device.")
    torch_threads: int | None = Field(
        None, ge=1, description="torch intra-op threads (None: leave torch's default)."
    )
    share_prompt: bool | None = Field(
        None,
        description="Run each group's prompt once (same update, fewer FLOPs): the prompts and their "
        "completions as one row of tokens with attention by segment (one learner process), or each "
        "prompt's KV cache continued by its completions (a sharded learner). None: on a CPU for models "
        "of 20M+ parameters; off on a GPU, unmeasured there in the row layout, where the KV cache's "
        "second forward per micro-batch cost more launches than the FLOPs it saved.",
    )
    world_size: int = Field(
        1,
        ge=1,
        description="Learner processes (ranks). 1: the learner runs in the flow's process. N > 1: N Ray "
        "actors (needs scale.ray_address) in one torch.distributed group (NCCL on GPUs, gloo on CPU), "
        "the model sharded over them with FSDP2; each runs its share of a step's micro-batches and the "
        "update equals the single-process one. One GPU per rank when the Ray cluster has N GPUs.",
    )
    collective_timeout_s: float = Field(
        600.0,
        gt=0,
        description="With world_size > 1: a collective (and the ranks' start-up) waiting longer than "
        "this fails the step instead of hanging it; a rank that dies fails it at once.",
    )
    lora: LoraConfig | None = Field(
        None,
        description="Train a LoRA adapter (peft) instead of every weight: only the adapter gets gradients "
        "and optimizer state, the KL reference is the base model with the adapter disabled, and each push "
        "sends only the adapter (sync.backend 'lora'). None: full fine-tuning.",
    )

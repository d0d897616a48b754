"""What makes a learner step faster without changing its numbers: torch.compile of the decoder layers
(`learner.compile`), and one bf16 cast of the float32 master weights per optimizer step.
"""

from __future__ import annotations

import contextlib

import torch


def one_cast_per_update(device: torch.device, dtype: torch.dtype, world_size: int):
    """The region around one update's micro-batches (forwards and backwards, up to its optimizer step).

    Each forward runs in an autocast region of its own, and autocast casts the float32 master weights
    to the compute dtype in each: a step of 8 micro-batches made 8 bf16 copies of the model. autocast
    keeps its casts of trainable weights until the outermost autocast region ends, and a region counts
    whether it is enabled or not: inside this one (disabled, so the backwards run outside autocast, as
    they should) the first forward's casts serve every micro-batch of the update, and they are dropped
    before the optimizer changes the weights. What runs under no_grad inside it (the KL reference: a
    frozen model, or the LoRA base with its adapter off) reads frozen weights only, which autocast
    never keeps; a trainable weight's cast made under no_grad would carry no gradient into the next
    forward (pi_old of later updates is taken before, outside it). Off in float32 (no casts) and for a
    sharded learner (FSDP unshards and reshards each layer around its forward; a kept cast would hold
    the whole layer)."""
    if dtype == torch.float32 or world_size > 1:
        return contextlib.nullcontext()
    return torch.autocast(device.type, enabled=False)


def compile_layers(model) -> int:
    """torch.compile each decoder layer of `model` in place (`learner.compile`); how many. The layers,
    not the whole model: each layer is the same code, compiled once and run N times, and what lies
    around them (the LM head's log-softmax, the loss) stays as it is. Fusing each layer's RMSNorm, RoPE
    and SwiGLU elementwise work with its casts is where a GPU step's non-matmul time went
    (BENCHMARKS.md, "The learner on an H100")."""
    layers = [m for m in model.modules() if type(m).__name__.endswith("DecoderLayer")]
    if not layers:
        raise ValueError(
            f"learner.compile: {type(model).__name__} has no module named *DecoderLayer to compile; "
            "set learner.compile false"
        )
    for layer in layers:
        layer.compile()
    return len(layers)

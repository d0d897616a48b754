"""A learner's resumable state on disk, beside its model dir: the optimizer (torch.distributed.
checkpoint shards, loadable at any world size), the LR schedule, the RNG state, the tokenizer.

Layout of a checkpoint dir: `model/` (a complete model dir, written by the learner) or, for a LoRA
learner, `adapter/` (the adapter in PEFT's format; `learner.json` names the base model it goes on),
`optimizer/` (for LoRA: the adapter's optimizer state alone), `trainer_state.pt`, `learner.json`. Every rank of a sharded learner calls `save_optimizer` and
`load_trainer_state`; rank 0 alone calls `save_trainer_state`.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import torch

from grpoflow.tasks.learner.fsdp import one_process_dcp
from grpoflow.tasks.learner.learner_api import MODEL_DIR

# The optimizer's state in a checkpoint: torch.distributed.checkpoint shards, loadable at any world size.
OPTIMIZER_DIR = "optimizer"


def save_optimizer(model, optimizer, directory: Path, world_size: int) -> None:
    """The optimizer's state (this rank's shards of it) under `directory / OPTIMIZER_DIR`."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    state = get_optimizer_state_dict(model, optimizer)
    with one_process_dcp(world_size):
        dcp.save(
            {"optimizer": state}, checkpoint_id=str(Path(directory) / OPTIMIZER_DIR), no_dist=world_size == 1
        )


def save_trainer_state(
    directory: Path, scheduler, world_size: int, tokenizer_path: str, base_model: str | None = None
) -> None:
    """The schedule, the RNG state and the tokenizer (into `model/`, so the checkpoint's model dir is
    a complete model dir: vLLM and resume can load it alone). `base_model`: a LoRA checkpoint's base,
    recorded in `learner.json` (its adapter dir holds no tokenizer: the base model's is the one)."""
    from transformers import AutoTokenizer

    directory = Path(directory)
    if base_model is None:
        AutoTokenizer.from_pretrained(tokenizer_path).save_pretrained(directory / MODEL_DIR)
    torch.save(
        {"scheduler": scheduler.state_dict(), **rng_state(), "world_size": world_size},
        directory / "trainer_state.pt",
    )
    info = {"tokenizer": tokenizer_path} | ({"base_model": base_model} if base_model is not None else {})
    (directory / "learner.json").write_text(json.dumps(info))


def learner_info(directory: Path) -> dict:
    """A checkpoint's `learner.json`: its tokenizer, and for a LoRA checkpoint its base model."""
    path = Path(directory) / "learner.json"
    return json.loads(path.read_text()) if path.is_file() else {}


def load_trainer_state(directory: Path, model, optimizer, scheduler, *, world_size: int, lr: float) -> None:
    """Restore optimizer, scheduler and RNG from a checkpoint dir, at `world_size` whatever the
    writer's was; the configured peak `lr` wins over the checkpoint's."""
    directory = Path(directory)
    trainer = torch.load(directory / "trainer_state.pt", weights_only=True)  # tensors and plain data only
    # The saved parameter groups name the AdamW kernel of the learner that wrote them (fused for one
    # process, multi-tensor for FSDP2's shards); this learner keeps the one it chose.
    kernels = [(g.get("fused"), g.get("foreach")) for g in optimizer.param_groups]
    if (directory / OPTIMIZER_DIR).is_dir():
        _load_optimizer(directory / OPTIMIZER_DIR, model, optimizer, world_size)
    else:  # a checkpoint from before the optimizer went into DCP: one process's state dict
        if world_size > 1:
            raise ValueError(
                f"{directory} holds a single-process optimizer state (trainer_state.pt); resume it "
                "with learner.world_size 1 (its next checkpoint loads at any world size)"
            )
        optimizer.load_state_dict(trainer["optimizer"])
    for group, (fused, foreach) in zip(optimizer.param_groups, kernels, strict=True):
        group["fused"], group["foreach"] = fused, foreach
    scheduler.load_state_dict(trainer["scheduler"])
    # A retrain may change the learning rate: the schedule keeps its place, scaled to the configured peak.
    if any(base != lr for base in scheduler.base_lrs):
        scheduler.base_lrs = [lr] * len(scheduler.base_lrs)
        for group, factor in zip(optimizer.param_groups, scheduler.lr_lambdas, strict=True):
            group["initial_lr"] = lr
            group["lr"] = lr * factor(scheduler.last_epoch)
    set_rng_state(trainer)


def rng_state() -> dict:
    """Every random state that decides what a step does: Python's, torch's CPU generator, numpy's
    global one (when numpy is loaded) and each CUDA device's (when CUDA is up). Plain data and tensors,
    so the file loads with `torch.load(weights_only=True)`."""
    import sys

    version, state, gauss = random.getstate()
    out = {"torch_rng": torch.get_rng_state(), "python_rng": [version, list(state), gauss]}
    if "numpy" in sys.modules:
        kind, keys, pos, has_gauss, cached = sys.modules["numpy"].random.get_state()
        out["numpy_rng"] = [kind, torch.from_numpy(keys.astype("int64")), pos, has_gauss, cached]
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out["cuda_rng"] = torch.cuda.get_rng_state_all()
    return out


def set_rng_state(saved: dict) -> None:
    """Restore what `rng_state` saved (a checkpoint from before numpy's and CUDA's were kept restores
    the rest)."""
    version, state, gauss = saved["python_rng"]
    random.setstate((version, tuple(state), gauss))
    torch.set_rng_state(saved["torch_rng"])
    if "numpy_rng" in saved:
        import numpy as np

        kind, keys, pos, has_gauss, cached = saved["numpy_rng"]
        np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    if "cuda_rng" in saved and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(saved["cuda_rng"])


def _load_optimizer(directory: Path, model, optimizer, world_size: int) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

    # The template (each rank's shard of every state tensor) is filled from the saved shards.
    state = {"optimizer": get_optimizer_state_dict(model, optimizer)}
    with one_process_dcp(world_size):
        dcp.load(state, checkpoint_id=str(directory), no_dist=world_size == 1)
    set_optimizer_state_dict(model, optimizer, state["optimizer"])

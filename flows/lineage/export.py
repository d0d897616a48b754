"""`grpoflow export RUN [--step N] [--merge] --out DIR`: a run's checkpoint as a directory other tools load.

A full fine-tuning checkpoint exports its model dir (safetensors, config, tokenizer) as it is. A LoRA
checkpoint exports its adapter in PEFT's format (`PeftModel.from_pretrained(base, DIR)`; its
`adapter_config.json` names the base model), or with `--merge` the base model with the adapter merged
in: a standalone model dir that plain `AutoModelForCausalLM.from_pretrained(DIR)` loads. The output
appears whole or not at all (an atomic publish), and an existing non-empty DIR is never overwritten.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

from grpoflow.flows.config import ConfigError
from grpoflow.storage.checkpoints import CheckpointNotFoundError, CheckpointStore
from grpoflow.storage.ids import validate_run_id
from grpoflow.storage.rollouts import RolloutStore, atomic_publish_dir
from grpoflow.tasks.learner.learner_api import ADAPTER_DIR, MODEL_DIR


@dataclass
class Exported:
    out: Path
    step: int
    kind: str  # "model", "adapter" or "merged"


def check_new_dir(out: Path, what: str) -> None:
    """Refuse, naming `what` (the argument), an output directory that exists and is not empty: an export
    never writes into what is there."""
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConfigError(f"{what}: {out} exists and is not an empty directory; name a new one")


def export_checkpoint(
    root: str | Path, run_id: str, out: str | Path, step: int | None = None, merge: bool = False
) -> Exported:
    """Export run `run_id`'s checkpoint at `step` (default: the latest) to `out` (module doc)."""
    root, out = Path(root), Path(out)
    ckpt, step = _checkpoint(root, validate_run_id(run_id), step)
    check_new_dir(out, "--out")
    adapter = ckpt / ADAPTER_DIR
    if not adapter.is_dir():
        atomic_publish_dir(out, lambda tmp: shutil.copytree(ckpt / MODEL_DIR, tmp, dirs_exist_ok=True))
        return Exported(out, step, "model")
    if not merge:
        atomic_publish_dir(out, lambda tmp: shutil.copytree(adapter, tmp, dirs_exist_ok=True))
        return Exported(out, step, "adapter")
    from grpoflow.tasks.learner.checkpoint_io import learner_info
    from grpoflow.tasks.learner.lora import merge as merge_adapter

    info = learner_info(ckpt)
    base = info.get("base_model")
    if not base or not Path(base).is_dir():
        raise ConfigError(f"--merge: the base model of {ckpt} ({base!r}, from its learner.json) is not found")
    atomic_publish_dir(out, lambda tmp: merge_adapter(base, adapter, tmp, info.get("tokenizer")))
    return Exported(out, step, "merged")


def _checkpoint(root: Path, run_id: str, step: int | None) -> tuple[Path, int]:
    if RolloutStore(root).read_run_meta(run_id) is None:
        raise ConfigError(f"RUN: no run {run_id!r} under {root}")
    try:
        return CheckpointStore(root).at(run_id, step)
    except CheckpointNotFoundError as e:
        if e.step is None:
            raise ConfigError(f"RUN: run {run_id!r} has no checkpoint yet") from None
        raise ConfigError(f"--step: {e}; it has {e.steps}") from None

"""LoRA adapters on the learner's model (peft): attach one, check its target modules, write and merge it.

A LoRA learner loads the base model once, freezes it and trains only the adapter; the KL reference is
the same model with the adapter disabled (`tasks.learn.Learner`). What the servers load and what
checkpoints and exports hold is the adapter in PEFT's format (`adapter_config.json` +
`adapter_model.safetensors`): vLLM serves it as a LoRA adapter, and `merge` turns it into a standalone
model dir that plain transformers loads.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from grpoflow.tasks.config.learner import LoraConfig

ADAPTER_CONFIG = "adapter_config.json"


class LoraTargetError(ValueError):
    """`learner.lora.target_modules` names something that is not a linear layer of the model."""


def linear_modules(model_path: str | Path) -> set[str]:
    """The qualified names of the linear layers of the model at `model_path`, from its config alone
    (built on the meta device: no weights are read)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_path)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return {name for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)}


def check_targets(model_path: str | Path, lora: LoraConfig) -> None:
    """Every target must name (as peft matches: the whole name or its last parts) a linear layer of
    the model; raises LoraTargetError naming the field and the model's linear layers otherwise."""
    names = linear_modules(model_path)
    missing = [t for t in lora.target_modules if not any(n == t or n.endswith(f".{t}") for n in names)]
    if missing:
        leaves = sorted({n.rsplit(".", 1)[-1] for n in names})
        raise LoraTargetError(
            f"learner.lora.target_modules: {missing} name no linear layer of the model at {model_path}; "
            f"its linear layers are {leaves}"
        )


def attach(model, lora: LoraConfig, adapter: str | Path | None = None):
    """`model` with a trainable LoRA adapter (a new one, or the one saved under `adapter`), every base
    weight frozen. A new adapter starts as the identity (peft initialises B to zero): the policy
    before the first update is the base model."""
    from peft import LoraConfig as PeftLoraConfig
    from peft import PeftModel, get_peft_model

    if adapter is not None:
        return PeftModel.from_pretrained(model, str(adapter), is_trainable=True)
    config = PeftLoraConfig(
        r=lora.rank,
        lora_alpha=lora.alpha,
        lora_dropout=lora.dropout,
        target_modules=list(lora.target_modules),
        bias="none",
        task_type="CAUSAL_LM",
    )
    return get_peft_model(model, config)


def write_adapter(model, directory: Path) -> None:
    """The adapter of a peft `model` in PEFT's format, as vLLM's `load_lora_adapter` and
    `PeftModel.from_pretrained` read it (peft's model card left out)."""
    # peft also writes a model card, compiling its jinja template on every save: half of a push's save
    # of SmolLM2's rank-16 adapter (17 of 33 ms), for a file no loader reads. Skipped for this call.
    model.create_or_update_model_card = lambda *args, **kwargs: None
    try:
        model.save_pretrained(Path(directory), safe_serialization=True)
    finally:
        del model.create_or_update_model_card


def is_adapter(directory: str | Path) -> bool:
    return (Path(directory) / ADAPTER_CONFIG).is_file()


def merge(
    base_model: str | Path, adapter: str | Path, out: Path, tokenizer: str | Path | None = None
) -> Path:
    """The base model with the adapter merged into its weights, written to `out` as a standalone model
    dir (safetensors, config, tokenizer) that `AutoModelForCausalLM.from_pretrained` loads."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    base = AutoModelForCausalLM.from_pretrained(base_model, dtype="auto")  # the base's own dtype
    merged = PeftModel.from_pretrained(base, str(adapter)).merge_and_unload()
    merged.save_pretrained(out, safe_serialization=True)
    AutoTokenizer.from_pretrained(tokenizer or base_model).save_pretrained(out)
    return Path(out)

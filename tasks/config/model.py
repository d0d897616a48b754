"""The `model` section: which model the run trains, and the learner's compute dtype."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field

from grpoflow.tasks.config.section import Section


class ModelConfig(Section):
    path: str = Field(
        "tiny",
        description="Local model directory (config, safetensors, tokenizer). 'tiny' builds a random "
        "tiny Llama + byte-level tokenizer under <root>/models/tiny (tests and demo).",
    )
    dtype: Literal["auto", "float32", "bfloat16"] = Field(
        "auto",
        description="Learner compute dtype: auto = float32 on CPU, bfloat16 on GPU. bfloat16 computes under "
        "autocast over float32 master weights and optimizer state; pushes are written in it, and the "
        "run's own vLLM servers serve it on a CPU that computes bf16 natively (AMX or AVX512-BF16; not "
        "with run.reproducible), float32 on other CPUs.",
    )
    chat_template: str | None = Field(
        None,
        description="A Jinja chat template for a model without one, or to replace its own (TRL's "
        "chat_template_path): a file (relative paths also beside the config), or the template itself. "
        "The run's tokenizer carries it: generation, the warm-up, tool calls, checkpoints and exports. "
        "Only conversational prompts (lists of messages) are rendered with a template.",
    )


def cpu_computes_bf16(cpuinfo: str | Path = "/proc/cpuinfo") -> bool:
    """Does this machine's CPU compute bfloat16 natively: AMX or AVX512-BF16, as Linux lists its flags
    (what vLLM's CPU backend checks for its bf16 kernels)? False where the file cannot be read."""
    try:
        text = Path(cpuinfo).read_text()
    except OSError:
        return False
    for line in text.splitlines():
        if line.startswith("flags"):
            return bool({"amx_bf16", "avx512_bf16"} & set(line.partition(":")[2].split()))
    return False

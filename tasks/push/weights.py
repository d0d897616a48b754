"""The weights an inference server loads: a model dir of `model.safetensors` + `config.json`.

Both learners and the checkpoint weight push write through here. The safetensors writer is grpoflow's
own, not the library's `save_file`: a push recycles the oldest version's directory and this writer
overwrites its file in place, which is what made the SmolLM2 push faster (BENCHMARKS.md, "Weight push:
recycled versions": 0.07-0.15 s overwriting against 0.16-0.64 s for a new file). The library always
creates the file anew, and writing a new file the two take the same time (0.197 vs 0.213 s).
"""

from __future__ import annotations

import copy
import json
import struct
from pathlib import Path

import torch

from grpoflow.server.delta_file import SAFETENSORS_DTYPES

# torch dtype -> safetensors' name for it: grpoflow.server's table, which the server's reader uses
_SAFETENSORS_DTYPES = {dtype: name for name, dtype in SAFETENSORS_DTYPES.items()}


def save_weights(model, directory: Path, dtype: torch.dtype | None = None) -> None:
    """What vLLM's reload needs from an unsharded model: the safetensors weights (+ config.json, so
    the dir is a model dir). A tied parameter (lm_head = embed_tokens) is written once. `dtype`: the
    floating-point tensors are written in it (float32 master weights as the bf16 the servers run)."""
    seen: set[int] = set()
    tensors = {}
    for name, t in model.state_dict(keep_vars=True).items():
        if id(t) not in seen:
            seen.add(id(t))
            tensors[name] = t.detach()
    write_model_dir(tensors, model.config, directory, dtype)


def write_model_dir(
    tensors: dict[str, torch.Tensor], config, directory: Path, dtype: torch.dtype | None = None
) -> None:
    """`tensors` (one name per tensor: tied aliases left out) and the transformers `config` as a
    model dir in `directory`; floating-point tensors in `dtype` when given, which config.json states."""
    directory = Path(directory)
    write_safetensors(tensors, directory / "model.safetensors", dtype)
    if dtype is not None:
        config = copy.copy(config)
        config.dtype = dtype
    (directory / "config.json").write_text(config.to_json_string())


def write_safetensors(tensors: dict[str, torch.Tensor], path: Path, dtype: torch.dtype | None = None) -> None:
    """`tensors` as a safetensors file (an 8-byte little-endian header length, a JSON header of dtype,
    shape and byte offsets, then the tensors' bytes in order), written from each tensor's memory (a GPU
    tensor is copied to the CPU just before its turn). An existing file is overwritten in place, not
    replaced (the module doc says why)."""
    header: dict[str, dict] = {"__metadata__": {"format": "pt"}}  # transformers checks the format
    out = {
        name: dtype if dtype is not None and t.is_floating_point() else t.dtype for name, t in tensors.items()
    }
    offset = 0
    for name, t in tensors.items():
        size = t.numel() * out[name].itemsize
        header[name] = {
            "dtype": _SAFETENSORS_DTYPES[out[name]],
            "shape": list(t.shape),
            "data_offsets": [offset, offset + size],
        }
        offset += size
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)  # the data starts 8-byte aligned
    with open(path, "r+b" if Path(path).is_file() else "wb") as f:
        f.write(struct.pack("<Q", len(head)) + head)
        for name, t in tensors.items():
            t = t.detach().to(dtype=out[name]).to("cpu").contiguous()
            f.write(t.reshape(-1).view(torch.uint8).numpy().data if t.numel() else b"")
        f.truncate()

"""Serving a lineage's adapter under the lineage's own, fixed name on a long-lived LoRA server.

A run's pushes load each version under a new name (`<run>@v<N>`, tasks/lora_push.py); users of a
lineage instead ask for the lineage's name, whatever version it serves, so promotion and rollback
must change what one name points at while clients keep asking for it. vLLM offers two ways:
unload + load (between the two calls the name answers 404 to every client) and `load_inplace` (the
registry entry is replaced in one step under vLLM's per-name lock: the name never stops answering).
We take `load_inplace`, and always onto a path the name did not hold before, so that:

- no client of the lineage ever gets a 404 during a promotion or rollback;
- cached KV is keyed by adapter name and path: no request reuses KV of the previous adapter, and other
  lineages' adapters and caches are untouched (no server-wide prefix-cache reset);
- the cost: vLLM keeps the flag on the registered adapter and re-reads its files each engine step that
  runs it (one load of the tiny model's adapter takes ~6 ms; the per-step cost on a real model is not
  measured yet), until the name is next replaced. Requests already running on the name switch to the new weights at their next step (the
  same adapter id is kept), as a checkpoint promotion's running requests do.

Rollback below a lineage's first promotion serves the base model under the lineage's name: an
identity adapter (the lineage's adapter with every `lora_B` zeroed: its delta is exactly 0), written
once per lineage beside its promotion log.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from tasks.inference import InferenceError, InferenceHTTPError, VLLMClient
from tasks.push_api import WeightPushError

ADAPTER_WEIGHTS = "adapter_model.safetensors"


async def serve_adapter(client: VLLMClient, name: str, path: str) -> str:
    """Make `name` serve the adapter in `path` (the module doc): 'loaded' (a name the server did not
    hold), 'kept' (it already served `path`) or 'replaced' (swapped in place, never a 404)."""
    path = str(Path(path).resolve())
    held = {m.get("id"): m.get("root") for m in await client.models()}
    if held.get(name) == path:
        return "kept"
    if name not in held:
        try:
            await client.load_lora_adapter(name, path)
            return "loaded"
        except InferenceHTTPError as e:  # loaded meanwhile by another process: replace it in place
            if e.status != 400 or "already been loaded" not in e.body:
                raise
    await client.load_lora_adapter(name, path, inplace=True)
    return "replaced"


def identity_adapter(like: str | Path, out: Path) -> Path:
    """A PEFT adapter of `like`'s shape whose every `lora_B` is zero (the base model, served under an
    adapter name), written once at `out` (kept: its weights never change, so its cached KV stays
    valid); `out`."""
    if (out / ADAPTER_WEIGHTS).is_file():
        return out
    from safetensors.torch import load_file, save_file

    from storage.rollouts import atomic_publish_dir

    like = Path(like)
    tensors = load_file(str(like / ADAPTER_WEIGHTS))
    zeroed = {k: (v.zero_() if "lora_B" in k else v) for k, v in tensors.items()}
    if not any("lora_B" in k for k in zeroed):
        raise WeightPushError(f"{like} holds no lora_B weights: cannot derive the base model's adapter")

    def write(tmp: Path) -> None:
        shutil.copy(like / "adapter_config.json", tmp / "adapter_config.json")
        save_file(zeroed, str(tmp / ADAPTER_WEIGHTS), metadata={"format": "pt"})

    atomic_publish_dir(out, write)
    return out


async def serve_lineage(url: str, client: VLLMClient, name: str, path: str) -> str:
    """`serve_adapter` with the push's errors: a server that cannot take adapters raises
    LoraUnsupportedError saying how to start it; other failures leave it serving what it served."""
    from tasks.lora_push import _lora_error, adapter_rank

    try:
        return await serve_adapter(client, name, path)
    except InferenceError as e:
        raise _lora_error(e, url, name, path, 0, adapter_rank(path) or 0) from e

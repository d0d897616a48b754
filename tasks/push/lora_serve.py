"""Serving a lineage's adapter under the lineage's own, fixed name on a long-lived LoRA server.

A run's pushes load each version under a new name (`<run>@v<N>`, tasks/push/lora_push.py); users of a
lineage instead ask for the lineage's name, whatever version it serves, so promotion and rollback
must change what one name points at while clients keep asking for it. vLLM 0.32 has no good way:
unload + load leaves a window where the name answers 404, and `load_inplace` stays set on the
registered adapter, so the engine re-reads its files from disk at every step that runs it
(lora/worker_manager.py: add_adapter), until the name is next replaced.

So the lineage's name is an alias (grpoflow's middleware in the server,
grpoflow.server.alias) of an adapter loaded under an internal name of its own,
`<lineage>@<hash of its path>`, loaded once and never in place. A swap:

1. loads the new adapter under its internal name (kept if the server already holds it);
2. points the alias at it: every request from then on gets the new adapter, none ever a 404;
3. unloads the internal name the alias pointed at before, once the requests already rewritten to it
   have left the middleware (or `DRAIN_S` passed): vLLM resolves a request's adapter by name a few
   awaits after it arrives, so unloading at once could refuse one sent just before the swap. Requests
   already running keep their adapter (vLLM's unload drops only the registry entry; the adapter dirs
   are pinned checkpoint dirs that stay on disk, read again if the engine's adapter cache evicts them).

Cached KV is keyed by adapter name and path, and an internal name is bound to one path: no request
reuses KV of another adapter, rollback to a version reuses its own, other lineages are untouched, and
no server-wide prefix-cache reset is needed.

Rollback below a lineage's first promotion serves the base model under the lineage's name: an
identity adapter (the lineage's adapter with every `lora_B` zeroed: its delta is exactly 0), written
once per lineage beside its promotion log.
"""

from __future__ import annotations

import asyncio
import hashlib
import shutil
import time
from pathlib import Path

from grpoflow.server.protocol import ALIASES
from grpoflow.tasks.push.push_api import WeightPushError
from grpoflow.tasks.rollouts.inference import VLLMClient
from grpoflow.tasks.rollouts.inference_api import InferenceError, InferenceHTTPError, already_loaded

ADAPTER_WEIGHTS = "adapter_model.safetensors"
DRAIN_S = 30.0  # longest wait for requests rewritten to a replaced adapter before it is unloaded
DRAIN_POLL_S = 0.05


def internal_name(lineage: str, path: str) -> str:
    """The name the adapter in `path` is loaded under for `lineage` (one per path: a rollback to a
    version loads it under the name it had, so its cached KV stays valid)."""
    return f"{lineage}@{hashlib.sha256(str(path).encode()).hexdigest()[:12]}"


async def serve_adapter(client: VLLMClient, name: str, path: str, *, drain_s: float = DRAIN_S) -> str:
    """Make `name` serve the adapter in `path` (the module doc): 'loaded' (a name the server did not
    serve), 'kept' (it already served `path`) or 'replaced' (re-pointed: never a 404, no re-reads)."""
    path = str(Path(path).resolve())
    try:
        aliases = await client.aliases()
    except InferenceHTTPError as e:
        if e.status != 404:
            raise
        raise WeightPushError(
            f"{client.base_url} has no grpoflow alias middleware (GET {ALIASES}: 404), so "
            f"lineage {name!r} cannot be re-pointed without a 404 window: start the server with "
            "`grpoflow serve --lora-rank R` (or flows/processes/vllm_command.py's server_command)"
        ) from e
    held = {m.get("id"): m.get("root") for m in await client.models() if m.get("id") not in aliases}
    previous, target = aliases.get(name), internal_name(name, path)
    if previous == target and held.get(target) == path:
        return "kept"
    if held.get(target) is None:
        try:
            await client.load_lora_adapter(target, path)
        except InferenceHTTPError as e:  # loaded meanwhile by another process: the same path
            if not already_loaded(e):
                raise
    elif held[target] != path:
        raise WeightPushError(f"{client.base_url} holds {target!r} from {held[target]}, not {path}")
    previous = await client.set_alias(name, target)
    # A name loaded as an adapter itself (in place, by an older grpoflow) is shadowed by the alias.
    for old in {previous, name if name in held else None} - {None, target}:
        await _drain(client, old, drain_s)
        try:
            await client.unload_lora_adapter(old)
        except InferenceHTTPError as e:  # unloaded meanwhile (a concurrent swap): nothing to drop
            if e.status != 404:
                raise
    return "loaded" if previous is None else "replaced"


async def _drain(client: VLLMClient, target: str, drain_s: float) -> None:
    """Wait until no request rewritten to `target` is in the server, at most `drain_s`: one still
    there after it has long resolved its adapter (it is generating), so unloading cannot refuse it."""
    deadline = time.monotonic() + drain_s
    while (await client.alias_in_flight()).get(target) and time.monotonic() < deadline:
        await asyncio.sleep(DRAIN_POLL_S)


def identity_adapter(like: str | Path, out: Path) -> Path:
    """A PEFT adapter of `like`'s shape whose every `lora_B` is zero (the base model, served under an
    adapter name), written once at `out` (kept: its weights never change, so its cached KV stays
    valid); `out`."""
    if (out / ADAPTER_WEIGHTS).is_file():
        return out
    from safetensors.torch import load_file, save_file

    from grpoflow.storage.rollouts import atomic_publish_dir

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
    from grpoflow.tasks.push.lora_push import _lora_error, adapter_rank

    try:
        return await serve_adapter(client, name, path)
    except InferenceError as e:
        raise _lora_error(e, url, name, path, 0, adapter_rank(path) or 0) from e

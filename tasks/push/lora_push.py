"""The `lora` weight push (`sync.backend: lora`, chosen with `learner.lora`): versions as LoRA adapters.

Each version is a PEFT adapter dir in the weights store (a new dir per version, never a recycled
one), loaded with `/v1/load_lora_adapter` under its own name, `<run>@v<version>` (`model_name`), which
generation requests name. A request is thus served wholly by
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

import json
import threading
import time
from collections.abc import Callable
from pathlib import Path

from grpoflow.storage.checkpoints import weights_store
from grpoflow.storage.faults import failpoint
from grpoflow.tasks.config.inference import InferenceConfig, SyncConfig
from grpoflow.tasks.config.learner import VLLM_LORA_RANKS
from grpoflow.tasks.push.push_api import Sent, WeightPushError, WeightPushUnavailableError
from grpoflow.tasks.push.transport import Transport
from grpoflow.tasks.rollouts.cache_salt import renew_cache_salt
from grpoflow.tasks.rollouts.inference import VLLMClient, client_for
from grpoflow.tasks.rollouts.inference_api import (
    InferenceError,
    InferenceHTTPError,
    InferenceUnavailableError,
    already_loaded,
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
        self.transport = Transport(run_id, sync.transport)
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
        self.transport.forget(self.weights.list(self.run_id), self.client)  # servers' copies too

    async def load(
        self, url: str, path: str, version: int, on_loaded: Callable[[int], None] | None = None
    ) -> Sent:
        name, rank = self.model_name(version), require_adapter(path, version)
        async with self.client(url) as client:
            sent = await self.transport.deliver(client, path, version)
            failpoint("weight_push")
            try:
                replaced = await _load_adapter(client, name, sent.path)
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
        return sent

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


async def _load_adapter(client: VLLMClient, name: str, path: str) -> bool:
    """Load the adapter in `path` as `name`; True when the server held `name` already (a previous
    process of the run pushed this version number, or a load that timed out had gone through)."""
    try:
        await client.load_lora_adapter(name, path)
        return False
    except InferenceHTTPError as e:
        if not already_loaded(e):
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


def require_adapter(path: str, version: int, backend: str = "lora") -> int:
    """`adapter_rank`, or the push's error when `path` holds no readable adapter."""
    failed = f"weight push v{version} from {path} failed: the {backend} backend loads PEFT adapters"
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
        if missing_route:
            why = "it has no /v1/load_lora_adapter"
        elif "LoRA is not enabled" in body:
            why = "LoRA is not enabled"
        else:
            why = f"its --max-lora-rank is below the adapter's rank {rank}"
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

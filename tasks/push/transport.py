"""How a version's files reach a server (`sync.transport`): by path, or as bytes over the network.

Every backend saves a version in the learner's store and then loads it into each server
(tasks/push/push.py). A server on the learner's host (or sharing its filesystem) reads the version
where it lies: the push sends only its path (`path`). A server on another host with no shared
filesystem cannot: the push first sends the version's files into the server's own disk over HTTP
(tasks/push/upload.py, grpoflow's upload middleware in the server), then loads the path the server
answered (`network`). Pause, reload, merge, roll-back, versions and staleness are the same either way:
an upload happens before the server is paused, and a version that was not whole and checked is never
loaded (the server publishes it only after its checksums match).

`auto` asks each server, at its first load, whether its host can read the learner's files: the
pusher writes a small random probe file beside the version and the server answers its digest
(`POST` protocol.PROBE); a matching digest means `path`, anything else `network`. A server without
grpoflow's upload middleware cannot be asked and gets `path` (as before this existed). A server that cannot take
the transport chosen (`path` it cannot read, `network` without uploads) raises TransportError at its
first load, which a run does before its first step: one `error:` line naming the server and the field.

On a server's disk, versions are named `<run>/v<NNNNNN>`; after each push those the learner's store no
longer keeps are deleted from every server that received them (`forget`), so a server's disk holds
what `sync.keep_last` (and the `lora` backend's grace) keeps on the learner's.

Over the network, a full-weights version in bf16 goes as a delta (`sync.delta`,
tasks/push/delta_push.py) to a server that holds this run's last upload: only the elements whose bits
changed, from which the server makes the whole version on its disk (server/delta_file.py); the
checksum it answers must be the learner's, else the version goes whole. Float32 versions always go
whole (a step changes every element), and no version is compressed: bf16/fp32 weights compress by a few
percent at a CPU cost far above the bridge's transfer time (BENCHMARKS.md, "Weights over the network").
A delta saves bytes on the link and costs CPU time on both ends (the learner compares two versions'
files, the server copies its base and patches it), so with `sync.delta: auto` each server's deltas go on
only while they take less time than its whole versions did (`DeltaCosts`).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import logging
import secrets
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING

from grpoflow.server.protocol import PROBE_PREFIX, UPLOAD_DIR_ENV
from grpoflow.tasks.config.choices import SyncTransport
from grpoflow.tasks.push.push_api import Sent, WeightPushError
from grpoflow.tasks.push.upload import WeightUploadError, local_files, upload_version
from grpoflow.tasks.rollouts.inference import VLLMClient
from grpoflow.tasks.rollouts.inference_api import InferenceError, InferenceHTTPError

if TYPE_CHECKING:  # torch: imported by whoever makes one (tasks/push/push.py)
    from grpoflow.tasks.push.delta_push import Deltas

PATH, NETWORK = Sent.PATH, Sent.NETWORK
RETRY_EVERY = 8  # sync.delta auto: while whole versions cost a server less, every 8th tries a delta again
log = logging.getLogger(__name__)


class DeltaCosts:
    """`sync.delta: auto`'s choice, per server: a delta unless the last delta to it took longer than the
    last whole version, and then every `retry_every`-th version a delta again (a link, a model's step
    size and the machines' load change). A delta's cost grows with the model (making and applying it),
    a whole version's with the link's time per byte: on this machine's bridge whole versions win at every
    size measured (BENCHMARKS.md, "Delta pushes over the network"). Seconds are an upload's, the delta's
    making included, the learner's own checksum passes not (the run's first is a full pass). A version
    sent whole asks the server for its checksum (a full pass over it there) only when a delta may
    follow it (`want_base`): the next push, or the retry's."""

    def __init__(self, retry_every: int = RETRY_EVERY):
        self.retry_every = retry_every
        self._lock = threading.Lock()
        self._last: dict[str, dict[bool, float]] = {}  # server URL -> {went as a delta: seconds}
        self._wholes: dict[str, int] = {}  # server URL -> whole versions since its last delta

    def want_delta(self, url: str) -> bool:
        """Send this version to the server at `url` as a delta (where one applies)."""
        return self._within(url, 1)

    def want_base(self, url: str) -> bool:
        """Check this version, sent whole, on the server at `url`: the next may go as a delta from it."""
        return self._within(url, 2)

    def _within(self, url: str, ahead: int) -> bool:
        """Deltas pay for this server, or its retry is at most `ahead` versions away."""
        with self._lock:
            last = self._last.get(url, {})
            if True not in last or False not in last or last[True] <= last[False]:
                return True
            return self._wholes.get(url, 0) + ahead >= self.retry_every

    def record(self, url: str, delta: bool, seconds: float) -> None:
        with self._lock:
            self._last.setdefault(url, {})[delta] = seconds
            self._wholes[url] = 0 if delta else self._wholes.get(url, 0) + 1


class TransportError(WeightPushError):
    """A server cannot take the transport `sync.transport` chooses: the message names the server, what
    it answered and what to change."""


class Transport:
    """The transport of each server a run's pusher loads into: chosen at its first load by `mode`
    (the module doc), then kept."""

    def __init__(
        self,
        run_id: str,
        mode: SyncTransport = "auto",
        recycle: int | None = None,
        deltas: Deltas | None = None,
        delta_costs: DeltaCosts | None = None,
    ):
        self.run_id, self.mode, self.recycle, self.deltas = run_id, mode, recycle, deltas
        self.delta_costs = delta_costs  # None: a delta wherever one applies (`sync.delta: on`)
        self._lock = threading.Lock()  # a reviver thread may load while the run's push forgets
        self._chosen: dict[str, str] = {}  # server URL -> PATH or NETWORK
        # server URL -> (name, learner's dir) of the last version uploaded to it whole or checked: the
        # base of its next delta
        self._uploaded: dict[str, tuple[str, str]] = {}

    def chosen(self) -> dict[str, str]:
        """Server URL -> the transport its versions take, for the servers loaded into so far."""
        with self._lock:
            return dict(self._chosen)

    def remote_name(self, version: int) -> str:
        return f"{self.run_id}/v{version:06d}"

    async def deliver(self, client: VLLMClient, path: str, version: int, serving: str | None = None) -> Sent:
        """Make the version in `path` (on the learner's disk) readable by the server: its path there.
        `serving`: the path the server serves now (never recycled)."""
        return await self.deliver_as(client, path, self.remote_name(version), serving=serving)

    async def deliver_as(
        self, client: VLLMClient, path: str, name: str, *, reuse: bool = False, serving: str | None = None
    ) -> Sent:
        """`deliver` under the name `name` on the server's disk; with `reuse`, a version the server
        already holds under that name is not sent again (for dirs that never change once written:
        a pinned checkpoint's adapter, which the server may be reading). With `recycle` (the
        checkpoint backend's keep_last), the upload overwrites the oldest of this run's versions on
        the server once it holds that many, never the one it serves: what the next `forget` drops."""
        if await self.choose(client, path) == PATH:
            return Sent(PATH, path)
        t0 = time.perf_counter()
        recycle, base = None, None
        if reuse or self.recycle or self.deltas is not None:
            root, held = await client.uploaded()  # one request for all three
            if reuse and name in held:
                return Sent(NETWORK, f"{root}/{name}", 0, time.perf_counter() - t0)
            with self._lock:
                base = self._uploaded.get(client.base_url)
            base = base if base is not None and base[0] in held and base[0] != name else None
            mine = sorted(v for v in held if v.startswith(f"{self.run_id}/v") and v != name)
            mine = [v for v in mine if base is None or v != base[0]]  # the delta's base stays
            if self.recycle and mine and len(mine) + (base is not None) >= self.recycle:
                recycle = mine[0] if f"{root}/{mine[0]}" != serving else None
        sums = self.deltas is not None and not reuse and await asyncio.to_thread(self.deltas.applies, path)
        sent, costs, url = None, self.delta_costs, client.base_url
        if sums and base is not None and (costs is None or costs.want_delta(url)):
            t1 = time.perf_counter()
            sent = await self._send_delta(client, path, name, recycle, base)
            if sent is not None and costs is not None:
                costs.record(url, True, time.perf_counter() - t1)
        if sent is None:
            t1 = time.perf_counter()
            check = sums and (costs is None or costs.want_base(url))
            answer = await upload_version(client, path, name, recycle=recycle, checksums=check)
            if sums and costs is not None:
                costs.record(url, False, time.perf_counter() - t1)
            sums = check and "checksums" in answer  # a server of an older grpoflow takes no deltas
            if sums:
                await self._check(client, path, name, answer)
            size = sum(n for _, n in await asyncio.to_thread(local_files, Path(path)))
            sent = Sent(NETWORK, answer["path"], size)
        if sums:
            with self._lock:
                self._uploaded[client.base_url] = (name, path)
        return dataclasses.replace(sent, seconds=time.perf_counter() - t0)

    async def _send_delta(
        self, client: VLLMClient, path: str, name: str, recycle: str | None, base: tuple[str, str]
    ) -> Sent | None:
        """Upload the version in `path` as its delta from `base` (the name of the server's copy, the
        learner's dir), None when it should go whole instead: no delta pays, or the server refused it or
        made a version whose checksum is not the learner's (its base differed), which is deleted."""
        folder = await asyncio.to_thread(self.deltas.delta, base[1], path)
        if folder is None:
            return None
        try:
            answer = await upload_version(client, folder, name, recycle=recycle, base=base[0])
        except WeightUploadError as e:
            if not isinstance(e.__cause__, InferenceHTTPError) or e.__cause__.status not in (404, 422):
                raise
            log.warning(
                "%s refused the delta of %s from %s; sending it whole: %s", client.base_url, name, base[0], e
            )
            return None
        want = await asyncio.to_thread(self.deltas.checksums, path)
        if answer.get("checksums") != want:
            log.warning(
                "%s made %s from %s with checksums %s, the learner's are %s; sending it whole",
                client.base_url,
                name,
                base[0],
                answer.get("checksums"),
                want,
            )
            with contextlib.suppress(InferenceError):
                await client.delete_uploaded_version(name)
            return None
        size = sum(n for _, n in await asyncio.to_thread(local_files, folder))
        return Sent(NETWORK, answer["path"], size, delta=True)

    async def _check(self, client: VLLMClient, path: str, name: str, answer: dict) -> None:
        """A version sent whole holds what the learner's does (the base of the next delta)."""
        want = await asyncio.to_thread(self.deltas.checksums, path)
        if answer.get("checksums") != want:
            raise WeightPushError(
                f"the vLLM server at {client.base_url} holds {name} with checksums {answer.get('checksums')}, "
                f"the learner's {path} has {want}: its disk changed the bytes after they were checked"
            )

    async def choose(self, client: VLLMClient, path: str) -> str:
        """The server's transport (asked at its first load, the module doc)."""
        url = client.base_url
        with self._lock:
            if url in self._chosen:
                return self._chosen[url]
        how = await self._ask(client, Path(path).parent)
        with self._lock:
            self._chosen[url] = how
        return how

    async def _ask(self, client: VLLMClient, folder: Path) -> str:
        readable, uploads = await _probe(client, folder)
        url, field = client.base_url, f"sync.transport is {self.mode!r}"
        if readable is None:  # no grpoflow plugin: it cannot be asked, nor take uploads
            if self.mode != NETWORK:
                return PATH
            raise TransportError(
                f"{field} but the vLLM server at {url} has no grpoflow upload route (HTTP 404): start it "
                "with `grpoflow serve` (or the policy-server deployment), or set sync.transport 'path' "
                "if it reads the learner's store"
            )
        if readable and self.mode != NETWORK:
            return PATH
        if not readable and self.mode == PATH:
            raise TransportError(
                f"{field} but the vLLM server at {url} cannot read the learner's files (a probe written "
                f"in {folder} was not readable there): set sync.transport 'network' (or 'auto') to send "
                "versions over HTTP, or give it the learner's store at the same path"
            )
        if uploads:
            return NETWORK
        why = "" if readable else f" and cannot read the learner's files in {folder}"
        raise TransportError(
            f"{field} but the vLLM server at {url} takes no uploads (started without "
            f"{UPLOAD_DIR_ENV}){why}: start it with `grpoflow serve`, which keeps uploads under its "
            "store root"
        )

    def forget(self, keep: Iterable[int], client: Callable[[str], VLLMClient]) -> None:
        """Delete from every server that received versions over the network this run's versions not in
        `keep` (best effort: one that fails is deleted at the next push)."""
        urls = [u for u, how in self.chosen().items() if how == NETWORK]
        if not urls:
            return
        keep_names = {self.remote_name(v) for v in keep}
        prefix = f"{self.run_id}/"

        async def one(url: str) -> None:
            with contextlib.suppress(InferenceError):
                async with client(url) as c:
                    for name in await c.uploaded_versions():
                        if name.startswith(prefix) and name not in keep_names:
                            await c.delete_uploaded_version(name)

        async def every() -> None:
            await asyncio.gather(*(one(u) for u in urls))

        asyncio.run(every())


async def _probe(client: VLLMClient, folder: Path) -> tuple[bool | None, bool]:
    """(can the server read a file just written in `folder`, does it take uploads); (None, False)
    without grpoflow's plugin. A folder the learner cannot write to counts as unreadable there."""
    token = secrets.token_hex(16)
    probe = folder / f"{PROBE_PREFIX}{secrets.token_hex(16)}"
    try:
        await asyncio.to_thread(probe.write_text, token)
    except OSError:
        probe = None
    try:
        answer = await client.probe(str(probe.resolve()) if probe else f"/{PROBE_PREFIX}{'0' * 32}")
    except InferenceHTTPError as e:
        if e.status == 404:
            return None, False
        raise
    finally:
        if probe is not None:
            with contextlib.suppress(OSError):
                probe.unlink()
    readable = probe is not None and answer["sha256"] == hashlib.sha256(token.encode()).hexdigest()
    return readable, bool(answer["uploads"])

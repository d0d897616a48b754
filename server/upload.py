"""ASGI middleware loaded INTO the vLLM server (`--middleware grpoflow.server.upload.WeightUpload`): a weight
version sent as bytes over HTTP, for a server on another host that cannot read the learner's disk.

The server keeps received versions in `GRPOFLOW_UPLOAD_DIR` (a directory on its own host; unset: every
route below answers 404 "uploads are off on this server"). A committed version is a plain directory
there, which the usual reload (`collective_rpc grpoflow_reload_weights` / `reload_weights`) then loads
by its path: the server's workers share its host's disk.

- `POST /grpoflow/uploads` {"name": "<run>/v000003", "files": [{"path": "model.safetensors", "size":
  N}, ...]} -> {"upload": id}. Names are relative, "/"-separated, at most 8 deep, with no "", ".",
  "..", backslash, NUL or control character; a version name has no hidden component (".incoming-*"
  and ".trash-*" under the upload dir are this module's). A total over `GRPOFLOW_UPLOAD_MAX_BYTES`
  (default 64 GiB), or over the disk's free space, is refused (413, 507); a name that is, or is inside,
  a folder that is not an uploaded version is 409. The files are created empty in a staging dir
  `.incoming-<id>`; with "recycle": "<a committed version>" that version's dir becomes the staging dir
  instead, its files overwritten in place (the pusher names one it is about to drop). Stale uploads are swept here, the one rule being "one writer per name": an
  unfinished upload of the same name (a pusher that died and tries again), one idle for an hour, and
  any staging dir no upload of this process owns (a restarted server's leftovers) are removed.
  With "base": "<a committed version>" (a delta push: tasks/push/delta_push.py) the version is made
  from that one: a declared file `X.delta` is a delta of the base's `X` (server/delta_file.py), and the
  base's files not declared are carried over; with "checksums": true the commit also answers the
  checksum of every safetensors file (server/delta.py).
- `PUT /grpoflow/uploads/<id>/<file path>?offset=K&crc32=C`, the raw bytes as the body, C their CRC-32
  as 8 hex digits -> {"written": n}: streamed to the file at offset K as `receive()` yields it (at
  most about WRITE_BATCH bytes held, each batch written with one pwritev on a thread, its writeback
  started at once: this runs on vLLM's API server event loop), summed as it comes. A write past the
  file's declared size is 413, an unknown upload or file 404, a body shorter or longer than its
  Content-Length 400, a body whose CRC-32 is not C 422 (naming the file and the bytes), bytes another
  PUT of this upload is writing 503. A PUT is idempotent, so a client retries a failed chunk as it is,
  and several may run at once over distinct ranges, in any order.
- `POST /grpoflow/uploads/<id>/commit` (any body) -> {"path": the version's absolute path}. Every
  file must have its declared size and every byte of it must have come in a PUT that matched its
  CRC-32 and was not written over since (a 422 naming the file and the first range not covered; the
  staging dir is deleted: nothing half-written is ever at a committed name). Then the files are
  fsynced, a manifest `.grpoflow-upload.json` (sizes, and each chunk's range and CRC-32) written, and
  the staging dir renamed to `<dir>/<name>` (a version already there is renamed aside first, then
  deleted). A commit already running, or one while a PUT of the upload runs, answers 503 (a retry
  waits for it); one that succeeded answers its path again. A version made from a base is completed
  before its manifest is written (a delta that does not fit its base file: 422, nothing published), and
  its answer has "checksums": the base's (kept in its manifest) plus each delta's change.
- `POST /grpoflow/probe` {"path": "/abs/dir/.grpoflow-probe-<32 hex>"} -> {"sha256": hex or null,
  "uploads": bool}: whether this server's host can read a file the pusher just wrote beside its
  weights (the digest of its content, null when it cannot be read) and whether uploads are on. Answered
  also with uploads off; only a file named so, at most PROBE_MAX_BYTES long, is ever read: the route
  says nothing of any other file (tasks/push/transport.py chooses a server's transport with it).
- `DELETE /grpoflow/uploads/<id>` aborts (removes the staging dir); `GET /grpoflow/versions` ->
  {"root": dir, "versions": [name, ...]} (the dirs holding a manifest); `DELETE
  /grpoflow/versions/<name>` removes a committed version (a dir holding a manifest, nothing else).

Authentication: none here. `auth.RequireApiKey` guards every path but the health probes when
the server has a key. vLLM adds each `--middleware` with Starlette's `add_middleware`, which makes the
last one given the outermost, so RequireApiKey is given after this one (flows/processes/serve.py) and checks the
key before any upload route runs.

The disk side is upload_store.py (called on a thread). The table of uploads in progress lives
in this API server process: one upload in flight when the server restarts is lost, and its staging dir
swept by the next create. Standard library only; the names and shapes on the wire are protocol.py's.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import secrets
import shutil
import time
from urllib.parse import parse_qs

from grpoflow.server import upload_store as store
from grpoflow.server.http import reply_json, route
from grpoflow.server.protocol import (
    CHUNK_CRC32,
    CHUNK_OFFSET,
    COMMIT,
    PROBE,
    PROBE_NAME,
    PROBE_PREFIX,
    UPLOAD_DIR_ENV,
    UPLOAD_MAX_BYTES_ENV,
    UPLOADS,
    VERSIONS,
    Aborted,
    ChunkWritten,
    Committed,
    Error,
    ProbeAnswer,
    UploadCreated,
    VersionDeleted,
    VersionList,
)
from grpoflow.server.upload_store import File, Refused, Upload

PROBE_MAX_BYTES = 64
DEFAULT_MAX_BYTES = 64 << 30
MAX_JSON_BYTES = 4 << 20  # a create or commit body
WRITE_BATCH = 1 << 20  # bytes gathered from receive() before one write on a thread
IDLE_S = 3600.0  # an upload untouched this long is swept by the next create
KEEP_COMMITTED = 256  # commits remembered, so that a retried commit gets its answer again


class _Gone(Exception):
    """The client went away mid-request: nobody to answer."""


class WeightUpload:
    def __init__(self, app):
        self.app = app
        folder = os.environ.get(UPLOAD_DIR_ENV)
        self.root = os.path.abspath(folder) if folder else None
        self.max_bytes = int(os.environ.get(UPLOAD_MAX_BYTES_ENV) or DEFAULT_MAX_BYTES)
        self.uploads: dict[str, Upload] = {}
        self.committed: dict[str, Committed] = {}  # upload id -> the commit's answer

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path, method = route(scope)
        if not any(path == p or path.startswith(p + "/") for p in (UPLOADS, VERSIONS, PROBE)):
            return await self.app(scope, receive, send)
        body = _Body(receive)
        try:
            if path == PROBE and method == "POST":
                answer = ProbeAnswer(
                    sha256=await _probe(await _read_json(body)), uploads=self.root is not None
                )
                return await reply_json(send, answer)
            if self.root is None:
                raise Refused(404, f"uploads are off on this server: start it with {UPLOAD_DIR_ENV} set")
            answer = await self._dispatch(path, method, scope, body)
        except _Gone:
            return None
        except Refused as e:
            status, message = e.status, e.message
        except OSError as e:  # a full disk, say: the client's error names it
            status, message = 500, f"{method} {path}: {type(e).__name__}: {e}"
        else:
            return await reply_json(send, answer)
        await body.drain()  # an answer sent before the body is read may never reach the client
        await reply_json(send, Error(error=message), status)

    async def _dispatch(self, path: str, method: str, scope, body: _Body) -> dict:
        if path == UPLOADS and method == "POST":
            return await self._create(await _read_json(body))
        if path == VERSIONS and method == "GET":
            return VersionList(root=self.root, versions=await asyncio.to_thread(store.versions, self.root))
        if path.startswith(VERSIONS + "/") and method == "DELETE":
            name = store.relative_name(path[len(VERSIONS) + 1 :], "name", hidden=False)
            return VersionDeleted(
                deleted=name, path=await asyncio.to_thread(store.remove_version, self.root, name)
            )
        upload_id, _, rest = path[len(UPLOADS) + 1 :].partition("/")
        if method == "PUT" and rest:
            return await self._put(self._live(upload_id), rest, scope, body)
        if method == "POST" and rest == COMMIT:
            await body.drain()  # nothing in it is needed: the chunks came with their checksums
            return await self._commit(upload_id)
        if method == "DELETE" and not rest:
            return await self._abort(self._live(upload_id))
        raise Refused(404, f"no upload route {method} {path}")

    def _live(self, upload_id: str) -> Upload:
        up = self.uploads.get(upload_id)
        if up is None:
            raise Refused(404, f"no upload {upload_id!r} in progress on this server (aborted or superseded?)")
        return up

    async def _create(self, req: dict) -> dict:
        name = store.relative_name(req.get("name"), "name", hidden=False)
        files = store.declared_files(req.get("files"))
        total = sum(files.values())
        if total > self.max_bytes:
            raise Refused(
                413, f"{name}: {total} bytes is over this server's upload limit of {self.max_bytes}"
            )
        upload_id = secrets.token_hex(12)
        staging = os.path.join(self.root, store.STAGING + upload_id)
        recycle = req.get("recycle")
        if recycle is not None:
            recycle = store.relative_name(recycle, "recycle", hidden=False)
            if recycle == name:
                raise Refused(400, "field 'recycle': a version cannot be recycled into itself")
        base = req.get("base")
        if base is not None:
            base = store.relative_name(base, "base", hidden=False)
            if base == name:
                raise Refused(400, "field 'base': a version cannot be made from itself")
        checksums = req.get("checksums", False)
        if not isinstance(checksums, bool):
            raise Refused(400, f"field 'checksums' must be true or false, not {checksums!r}")
        declared = {p: File(n) for p, n in files.items()}
        up = Upload(upload_id, name, staging, declared, recycle=recycle, base=base, checksums=checksums)
        now = time.monotonic()
        for old in list(self.uploads.values()):  # one writer per name; an idle one is abandoned
            if not old.committing and (old.name == name or now - old.touched > IDLE_S):
                del self.uploads[old.id]
        self.uploads[up.id] = up  # before the sweep, so that a create running beside it keeps its dir
        try:
            await asyncio.to_thread(store.prepare, self.root, up, set(self.uploads))
        except BaseException:
            self.uploads.pop(up.id, None)
            raise
        return UploadCreated(upload=up.id)

    async def _put(self, up: Upload, rel: str, scope, body: _Body) -> dict:
        if rel not in up.files:
            raise Refused(404, f"upload {up.id} ({up.name}) declared no file {rel!r}")
        size = up.files[rel].size
        query = parse_qs(scope.get("query_string", b"").decode("latin-1"))
        offset, length = _offset(query.get(CHUNK_OFFSET, ["0"])[0]), _content_length(scope)
        want = store.crc32_hex(query.get(CHUNK_CRC32, [None])[0], f"{rel}: query field {CHUNK_CRC32!r}")
        if offset + (length or 0) > size:
            raise Refused(
                413, f"{rel}: bytes up to {offset + (length or 0)} are past its declared size {size}"
            )
        end = size if length is None else offset + length
        f = store.begin_chunk(up, rel, offset, end)
        checked = None  # (end, CRC-32) of the chunk, once it has arrived whole and matched the sender's
        try:
            written, crc = await _receive(up, rel, offset, size, body)
            if length is not None and written != length:
                raise Refused(400, f"{rel}: {written} bytes received, Content-Length said {length}")
            if (got := f"{crc:08x}") != want:
                raise Refused(
                    422,
                    f"{rel}: bytes {offset}..{offset + written} arrived with crc32 {got}, the sender's {want}",
                )
            checked = (offset + written, got)
        finally:
            store.end_chunk(f, offset, end, checked)
        return ChunkWritten(path=rel, offset=offset, written=written)

    async def _commit(self, upload_id: str) -> dict:
        if upload_id in self.committed:
            return self.committed[upload_id]
        up = self._live(upload_id)
        if up.committing:
            raise Refused(503, f"upload {upload_id} ({up.name}) is being committed: try again")
        if up.writing():
            raise Refused(503, f"upload {upload_id} ({up.name}) has a chunk still being written: try again")
        up.committing = True
        try:
            checksums = await asyncio.to_thread(store.verify, up, self.root)
            path = await asyncio.to_thread(store.publish, self.root, up)
        except BaseException as e:
            up.committing = False
            if isinstance(e, Refused):  # the upload is over: nothing of it stays
                self.uploads.pop(up.id, None)
                await asyncio.to_thread(shutil.rmtree, up.staging, True)
            raise
        self.uploads.pop(up.id, None)
        answer = Committed(path=path, checksums=checksums) if checksums else Committed(path=path)
        self.committed[up.id] = answer
        while len(self.committed) > KEEP_COMMITTED:
            del self.committed[next(iter(self.committed))]
        return answer

    async def _abort(self, up: Upload) -> dict:
        if up.committing:
            raise Refused(409, f"upload {up.id} ({up.name}) is being committed: too late to abort")
        del self.uploads[up.id]
        await asyncio.to_thread(shutil.rmtree, up.staging, True)
        return Aborted(aborted=up.id, name=up.name)


class _Body:
    """The request's `receive`, which knows whether the body has been read to its end."""

    def __init__(self, receive):
        self.receive, self.done = receive, False

    async def __call__(self) -> dict:
        message = await self.receive()
        self.done = message["type"] != "http.request" or not message.get("more_body", False)
        return message

    async def part(self) -> bytes:
        """The body's next piece; _Gone when the client went away instead."""
        message = await self()
        if message["type"] != "http.request":
            raise _Gone
        return message.get("body", b"")

    async def drain(self) -> None:
        """Read (and drop) what is left of the body."""
        while not self.done:
            await self()


async def _receive(up: Upload, rel: str, offset: int, size: int, body: _Body) -> tuple[int, int]:
    """Write the body at `offset` of `rel` as it arrives, in batches of about WRITE_BATCH, each on a
    thread while the next arrives; (bytes written, their CRC-32)."""
    written, batch, held, crc = 0, [], 0, 0
    writing = None  # the batch being written (in order: the next waits for it)
    try:
        while not body.done:
            batch.append(await body.part())
            held += len(batch[-1])
            if offset + written + held > size:
                raise Refused(413, f"{rel}: the body runs past its declared size {size}")
            if held >= WRITE_BATCH or (body.done and held):
                if writing is not None:
                    crc = await writing
                writing = asyncio.ensure_future(
                    asyncio.to_thread(store.write, up, rel, offset + written, batch, crc)
                )
                written, batch, held = written + held, [], 0
            up.touched = time.monotonic()
        if writing is not None:
            crc = await writing
    finally:
        if writing is not None and not writing.done():  # failed mid-body: let its write end first
            await asyncio.wait([writing])
    return written, crc


async def _read_json(body: _Body) -> dict:
    chunks, held = [], 0
    while not body.done:
        chunks.append(await body.part())
        held += len(chunks[-1])
        if held > MAX_JSON_BYTES:
            raise Refused(413, f"a JSON body over {MAX_JSON_BYTES} bytes")
    try:
        obj = json.loads(b"".join(chunks))
    except ValueError:
        obj = None
    if not isinstance(obj, dict):
        raise Refused(400, "the body must be a JSON object")
    return obj


async def _probe(req: dict) -> str | None:
    """The sha256 of the probe file `req["path"]` names, None when this host cannot read it."""
    path = req.get("path")
    if (
        not isinstance(path, str)
        or not os.path.isabs(path)
        or not PROBE_NAME.fullmatch(os.path.basename(path))
    ):
        raise Refused(400, f"field 'path': an absolute path to a file named {PROBE_PREFIX}<32 hex digits>")

    def read() -> str | None:
        try:
            with open(path, "rb") as f:
                data = f.read(PROBE_MAX_BYTES + 1)
        except OSError:
            return None
        return hashlib.sha256(data).hexdigest() if len(data) <= PROBE_MAX_BYTES else None

    return await asyncio.to_thread(read)


def _offset(value: str) -> int:
    if not (value.isascii() and value.isdigit()):
        raise Refused(400, f"offset must be a non-negative integer, not {value!r}")
    return int(value)


def _content_length(scope) -> int | None:
    for name, value in scope.get("headers") or []:
        if name.lower() == b"content-length":
            return int(value) if value.isdigit() else None
    return None

"""A weight version sent to a vLLM server as bytes, for a server whose host cannot read the learner's
disk: its files go over HTTP into the server's upload dir (grpoflow's upload middleware,
grpoflow.server.upload, whose doc has the protocol), and the path it answers is what the
server then reloads, as a push on one host reloads the learner's own path.

Each file goes in chunks of `chunk_bytes`, `streams` of them on their way at once (each read on a
thread while the others are sent, so the whole version is read once and at most `streams` chunks are
held in memory). Every chunk carries its CRC-32, which the server checks as it writes; a chunk whose
PUT fails is sent again (the client's retry policy: a PUT at an offset is idempotent). The commit
publishes the version only once every byte of every file came in a chunk that matched. Any failure
aborts the upload (the server drops what it got) and raises WeightUploadError naming the server, the
version and the file.

Why CRC-32 and several streams (BENCHMARKS.md, "Weights over the network"): on two cores the bytes'
hashing competed with the transfer (sha256 2.1 GB/s against CRC-32's 7.2 GB/s, on both ends), and one
chunk at a time left the connection idle while the server wrote the end of each chunk and answered.
The checksum guards against bytes lost or changed on the way or on the server's disk; who may push is
the API key's business.
"""

from __future__ import annotations

import asyncio
import os
import zlib
from pathlib import Path

from grpoflow.server.protocol import Committed
from grpoflow.storage.faults import failpoint
from grpoflow.tasks.push.push_api import WeightPushError, WeightPushUnavailableError
from grpoflow.tasks.rollouts.inference import VLLMClient
from grpoflow.tasks.rollouts.inference_api import InferenceError, InferenceUnavailableError

CHUNK_BYTES = 8 << 20
_BLOCK = 64 << 10  # a chunk cut smaller than CHUNK_BYTES is whole blocks of this
STREAMS = 3  # chunks on their way at once (BENCHMARKS.md: 2-3 beat 1 on two cores; 3 by a little)
COMMIT_TIMEOUT_S = 600.0  # the server may read a file again to check it (one written out of order)


class WeightUploadError(WeightPushError):
    """An upload failed; the message names the server, the version, and the file it was sending."""


class WeightUploadUnavailableError(WeightUploadError, WeightPushUnavailableError):
    """An upload failed because the server could not be reached (its retries ran out)."""


async def upload_dir(
    server: VLLMClient | str,
    local_dir: str | Path,
    name: str,
    *,
    chunk_bytes: int = CHUNK_BYTES,
    streams: int = STREAMS,
    api_key: str | None = None,
    commit_timeout_s: float = COMMIT_TIMEOUT_S,
    recycle: str | None = None,
) -> str:
    """Send every file under `local_dir` to the server (a client, or its URL and `api_key`) as the
    version `name` (e.g. "<run>/v000003"), written over the files of its version `recycle` if given
    (one the caller is done with: it is gone once this starts); the version's path on the server's
    host."""
    if isinstance(server, str):
        async with VLLMClient(server, api_key=api_key) as client:
            return await upload_dir(
                client,
                local_dir,
                name,
                chunk_bytes=chunk_bytes,
                streams=streams,
                commit_timeout_s=commit_timeout_s,
                recycle=recycle,
            )
    options = {"chunk_bytes": chunk_bytes, "streams": streams, "commit_timeout_s": commit_timeout_s}
    return (await upload_version(server, local_dir, name, recycle=recycle, **options))["path"]


async def upload_version(
    server: VLLMClient,
    local_dir: str | Path,
    name: str,
    *,
    chunk_bytes: int = CHUNK_BYTES,
    streams: int = STREAMS,
    commit_timeout_s: float = COMMIT_TIMEOUT_S,
    recycle: str | None = None,
    base: str | None = None,
    checksums: bool = False,
) -> Committed:
    """`upload_dir`, made from the committed version `base` if given (the files under `local_dir` are
    then what differs from it: deltas, server/delta_file.py), with `checksums` asked of the commit;
    the commit's answer (the version's path, and its weights files' checksums)."""
    local = Path(local_dir)
    files = await asyncio.to_thread(local_files, local)
    sending: list[str] = []  # the file of the chunk that failed, for the error
    try:
        upload_id = await server.upload_begin(
            name,
            [{"path": rel, "size": size} for rel, size in files],
            recycle,
            base=base,
            checksums=checksums,
        )
    except InferenceError as e:
        raise _failed(server, local, name, None, e) from e
    try:
        todo = chunks(files, chunk_bytes, streams)
        await _send_chunks(server, upload_id, local, todo, streams, sending, delta=base is not None)
        return await server.upload_commit(upload_id, timeout_s=commit_timeout_s)
    except BaseException as e:  # cancelled too: the server drops what it got
        await _abort(server, upload_id, e)
        if isinstance(e, InferenceError | OSError | WeightUploadError):
            raise _failed(server, local, name, sending[0] if sending else None, e) from e
        raise


def local_files(local_dir: Path) -> list[tuple[str, int]]:
    """(path relative to `local_dir`, "/"-separated; size) of every file under it, sorted."""
    out = []
    for folder, dirs, names in os.walk(local_dir):
        dirs.sort()
        for n in sorted(names):
            path = Path(folder) / n
            if path.is_file():
                out.append((path.relative_to(local_dir).as_posix(), path.stat().st_size))
    if not out:
        raise WeightUploadError(f"nothing to upload: {local_dir} holds no files")
    return out


def chunks(files: list[tuple[str, int]], chunk_bytes: int, streams: int) -> list[tuple[str, int, int]]:
    """(file, offset, length) of every chunk to send, file after file. A file of under `streams`
    chunks is cut into `streams` even ones (whole 64 KiB blocks), so that a small version (an adapter)
    is on its way at once over every stream rather than waiting for its one long chunk."""
    out = []
    for rel, size in files:
        even = -(-size // streams)  # rounded up, then to whole blocks
        step = min(chunk_bytes, max(_BLOCK, -(-even // _BLOCK) * _BLOCK))
        out += [(rel, at, min(step, size - at)) for at in range(0, size, step)]
    return out


async def _send_chunks(
    client: VLLMClient,
    upload_id: str,
    local: Path,
    todo: list[tuple[str, int, int]],
    streams: int,
    failed_at: list[str],
    *,
    delta: bool = False,
) -> None:
    """Send `todo`'s chunks, `streams` at once (each stream takes the next chunk left), each with its
    CRC-32; the first failure cancels the others and is raised, its file put in `failed_at`. `delta`:
    the chunks are a delta's (failpoint delta_chunk as well as upload_chunk)."""
    left = iter(todo)

    async def stream() -> None:
        for rel, offset, n in left:
            try:
                data, crc = await asyncio.to_thread(_read_summed, local / rel, offset, n)
                if len(data) < n:
                    raise WeightUploadError(
                        f"{local / rel} shrank to {offset + len(data)} bytes while it was being sent"
                    )
                await client.upload_chunk(upload_id, rel, offset, data, f"{crc:08x}")
            except BaseException:
                failed_at.append(rel)
                raise
            failpoint("upload_chunk")
            if delta:
                failpoint("delta_chunk")

    tasks = [asyncio.ensure_future(stream()) for _ in range(streams)]
    try:
        await asyncio.gather(*tasks)
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.wait(tasks)


def _read_summed(path: Path, offset: int, n: int) -> tuple[bytes, int]:
    """`n` bytes at `offset` (fewer if the file is shorter) and their CRC-32. Each read opens the file
    itself: a read still running on its thread when its task is cancelled holds no shared descriptor."""
    with open(path, "rb") as f:
        data = os.pread(f.fileno(), n, offset)
    return data, zlib.crc32(data)


async def _abort(client: VLLMClient, upload_id: str, cause: BaseException) -> None:
    try:
        await asyncio.wait_for(client.upload_abort(upload_id), timeout=30.0)
    except (InferenceError, TimeoutError) as e:  # the server sweeps it at the next upload of the name
        cause.add_note(f"aborting upload {upload_id} failed too: {e}")


def _failed(
    client: VLLMClient, local: Path, name: str, sending: str | None, e: BaseException
) -> WeightUploadError:
    where = f" at {sending}" if sending else ""
    unavailable = isinstance(e, InferenceUnavailableError)
    cls = WeightUploadUnavailableError if unavailable else WeightUploadError
    return cls(f"uploading {local} to the vLLM server at {client.base_url} as {name!r} failed{where}: {e}")

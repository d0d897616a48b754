"""The upload directory of upload.WeightUpload (its module doc has the protocol): the names it
accepts, the staging dirs, the writes, and the check and publication of a version. Everything here
touches the disk, so the middleware calls it on a thread. Standard library only, but for a version made
from a base (a delta push) or whose checksums are asked for: those import delta_file.py (torch and
safetensors, vLLM's own) when they run.
"""

from __future__ import annotations

import ctypes
import json
import os
import re
import secrets
import shutil
import threading
import time
import zlib
from dataclasses import dataclass, field

from grpoflow.server.protocol import DELTA_SUFFIX, MANIFEST

STAGING, TRASH = ".incoming-", ".trash-"
MAX_FILES, MAX_DEPTH, MAX_NAME = 10_000, 8, 1024
_IOV_MAX = 1024  # buffers one pwritev takes (Linux's IOV_MAX)
# Linux's sync_file_range (none elsewhere): a written batch starts on its way to the disk at once, so
# that the commit's fsync has little left to wait for (0.1 s of a 538 MB version's commit, else).
_START_WRITEBACK = getattr(ctypes.CDLL(None, use_errno=True), "sync_file_range", None)
_SYNC_FILE_RANGE_WRITE = 2
_HEX8 = re.compile(r"[0-9a-f]{8}")
# Held around the renames that publish or remove a version, so that two never interleave.
_rename_lock = threading.Lock()


class Refused(Exception):
    """An answer other than 200: its status and message."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status, self.message = status, message


@dataclass
class File:
    size: int
    # Chunks received whole and matching their CRC-32: offset -> (end, crc32 hex). They never overlap:
    # a PUT drops those it writes over before its first byte.
    checked: dict[int, tuple[int, str]] = field(default_factory=dict)
    writing: list[tuple[int, int]] = field(default_factory=list)  # [start, end) of the PUTs running
    lock: threading.Lock = field(default_factory=threading.Lock)


@dataclass
class Upload:
    id: str
    name: str
    staging: str
    files: dict[str, File]
    touched: float = field(default_factory=time.monotonic)
    committing: bool = False
    recycle: str | None = None  # a committed version whose files this upload overwrites in place
    base: str | None = None  # a committed version this one is made from (protocol.UploadCreate)
    checksums: bool = False  # the commit computes every safetensors file's checksum it does not know

    def writing(self) -> bool:
        return any(f.writing for f in self.files.values())


def relative_name(text, what: str, *, hidden: bool = True) -> str:
    """`text` if it is a safe relative "/"-separated name (the module doc), else a 400."""
    if not isinstance(text, str) or not text:
        raise Refused(400, f"{what} must be a non-empty string")
    bad = (
        len(text) > MAX_NAME
        or text.startswith("/")
        or any(c == "\\" or ord(c) < 32 or ord(c) == 127 for c in text)
        or len(parts := text.split("/")) > MAX_DEPTH
        or any(p in ("", ".", "..") or len(p.encode()) > 255 for p in parts)
        or (not hidden and any(p.startswith(".") for p in parts))
    )
    if bad:
        rule = f"relative, '/'-separated, at most {MAX_DEPTH} deep, no '', '.', '..', backslash or control character"
        raise Refused(400, f"{what} {text!r} refused: {rule}" + ("" if hidden else ", nothing hidden"))
    return text


def declared_files(files) -> dict[str, int]:
    """{path: size} of a create's "files", else a 400."""
    if not isinstance(files, list) or not 0 < len(files) <= MAX_FILES:
        raise Refused(400, f"files must be a list of 1 to {MAX_FILES} {{'path', 'size'}} objects")
    out: dict[str, int] = {}
    for f in files:
        path = relative_name(f.get("path") if isinstance(f, dict) else None, "file path")
        size = f.get("size")
        if type(size) is not int or size < 0:
            raise Refused(400, f"file {path!r}: size must be a non-negative integer, not {size!r}")
        if path in out or path == MANIFEST:
            raise Refused(400, f"file {path!r} is declared twice or is the server's own manifest")
        out[path] = size
    folders = {"/".join(p.split("/")[:i]) for p in out for i in range(1, p.count("/") + 1)}
    if clash := sorted(folders & out.keys()):
        raise Refused(400, f"file {clash[0]!r} is declared both as a file and as a folder")
    return out


def crc32_hex(text, what: str) -> str:
    """`text` if it is a CRC-32 as 8 hex digits (lower-cased), else a 400."""
    if not isinstance(text, str) or not _HEX8.fullmatch(text.lower()):
        raise Refused(400, f"{what} must be a CRC-32 as 8 hex digits, not {text!r}")
    return text.lower()


def begin_chunk(up: Upload, rel: str, start: int, end: int) -> File:
    """Claim [start, end) of `rel` for one PUT: the checked chunks it overlaps are checked no more; a
    503 while another PUT writes there (a client's retry of a PUT that has not ended yet)."""
    f = up.files[rel]
    with f.lock:
        if any(s < end and start < e for s, e in f.writing):
            raise Refused(503, f"{rel}: bytes {start}..{end} are being written by another request: try again")
        f.writing.append((start, end))
        for at, (stop, _) in list(f.checked.items()):
            if at < end and start < stop:
                del f.checked[at]
    return f


def end_chunk(f: File, start: int, end: int, checked: tuple[int, str] | None) -> None:
    """The PUT that claimed [start, end) is over; `checked`: (where its bytes end, their CRC-32) when
    they arrived whole and matched the sender's."""
    with f.lock:
        f.writing.remove((start, end))
        if checked is not None:
            f.checked[start] = checked


def uncovered(f: File) -> tuple[int, int] | None:
    """The first range of [0, size) no checked chunk covers, None when they cover it all."""
    at = 0
    for start in sorted(f.checked):
        if start > at:
            return at, start
        at = max(at, f.checked[start][0])
    return (at, f.size) if at < f.size else None


def check_target(root: str, name: str) -> None:
    """A 409 unless `name` is free or an uploaded version, and inside no uploaded version."""
    parts = name.split("/")
    for i in range(1, len(parts)):
        if os.path.isfile(os.path.join(root, *parts[:i], MANIFEST)):
            raise Refused(409, f"{name}: {'/'.join(parts[:i])} is an uploaded version, not a folder of them")
    target = os.path.join(root, name)
    if os.path.lexists(target) and not os.path.isfile(os.path.join(target, MANIFEST)):
        raise Refused(409, f"{name}: {target} exists and is not an uploaded version")


def prepare(root: str, up: Upload, live: set[str]) -> None:
    """Sweep what no live upload owns, then make `up`'s staging dir with its files, empty."""
    os.makedirs(root, exist_ok=True)
    check_target(root, up.name)
    with _rename_lock:  # a version renamed aside by a publish in progress may still go back
        entries = os.listdir(root)
    for entry in entries:
        if entry.startswith(TRASH) or (entry.startswith(STAGING) and entry[len(STAGING) :] not in live):
            shutil.rmtree(os.path.join(root, entry), ignore_errors=True)
    total, free = sum(f.size for f in up.files.values()), shutil.disk_usage(root).free
    if up.base is not None:  # its files are written too
        total += sum(os.path.getsize(os.path.join(root, up.base, rel)) for rel in _files_of(root, up.base))
    if total > free:
        raise Refused(507, f"{up.name}: {total} bytes do not fit in the {free} free under {root}")
    if not (up.recycle and _take(root, up)):
        os.mkdir(up.staging)
    for rel, f in up.files.items():
        path = os.path.join(up.staging, rel)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        if os.path.isfile(path):  # a recycled file: its pages are overwritten, not allocated again
            os.truncate(path, f.size)
        else:
            with open(path, "wb"):
                pass


def _take(root: str, up: Upload) -> bool:
    """Make the committed version `up.recycle` the staging dir (its manifest and the files `up` does
    not declare removed): writing over a file's cached pages is several times faster than filling new
    ones on a machine short of free memory (BENCHMARKS.md, "Weights over the network"). False when it
    is not a committed version."""
    relative_name(up.recycle, "recycle", hidden=False)
    source = os.path.join(root, up.recycle)
    with _rename_lock:
        if not os.path.isfile(os.path.join(source, MANIFEST)):
            return False
        os.rename(source, up.staging)
    os.unlink(os.path.join(up.staging, MANIFEST))
    if up.base is None:  # else the files made from the base go over these; the commit drops the rest
        _keep_only(up.staging, set(up.files))
    return True


def _relative_files(folder: str) -> list[str]:
    """Every file under `folder`, as a "/"-separated path relative to it, sorted."""
    out = []
    for here, _, names in os.walk(folder):
        out += [os.path.relpath(os.path.join(here, n), folder).replace(os.sep, "/") for n in names]
    return sorted(out)


def _keep_only(folder: str, keep: set[str]) -> None:
    """Remove every file under `folder` whose relative path is not in `keep`."""
    for rel in _relative_files(folder):
        if rel not in keep:
            os.unlink(os.path.join(folder, rel))


def _files_of(root: str, name: str) -> list[str]:
    """The files of the committed version `name` (a 404 if there is none), its manifest left out."""
    relative_name(name, "base", hidden=False)
    folder = os.path.join(root, name)
    if not os.path.isfile(os.path.join(folder, MANIFEST)):
        raise Refused(404, f"base {name!r}: no such uploaded version on this server")
    return [r for r in _relative_files(folder) if r != MANIFEST]


def write(up: Upload, rel: str, offset: int, pieces: list[bytes], crc: int) -> int:
    """Write `pieces`, one after the other, at `offset` (one pwritev, no joined copy); `crc` (the
    CRC-32 of what this PUT wrote before them) carried over them."""
    try:  # never O_CREAT: a write racing an abort finds its file gone instead of making it again
        fd = os.open(os.path.join(up.staging, rel), os.O_WRONLY)
    except FileNotFoundError:
        raise Refused(404, f"upload {up.id} ({up.name}) was aborted or superseded") from None
    try:
        views, at = [memoryview(p) for p in pieces if p], offset
        while views:
            n = os.pwritev(fd, views[:_IOV_MAX], at)
            at += n
            while views and n >= len(views[0]):
                n -= len(views.pop(0))
            if n:
                views[0] = views[0][n:]
        if _START_WRITEBACK is not None:  # a hint: its failure is the fsync's to report
            _START_WRITEBACK(fd, ctypes.c_int64(offset), ctypes.c_int64(at - offset), _SYNC_FILE_RANGE_WRITE)
    finally:
        os.close(fd)
    for p in pieces:
        crc = zlib.crc32(p, crc)
    return crc


def verify(up: Upload, root: str) -> dict[str, int]:
    """Every file has its declared size and every byte of it came in a chunk that matched its CRC-32
    (a 422 naming the file and the range if not), and is on disk; a version made from a base is
    completed from it (`derive`); then the manifest is written. The checksums known (`derive`'s, and
    with `up.checksums` every safetensors file's)."""
    for rel, f in up.files.items():
        path = os.path.join(up.staging, rel)
        size = os.stat(path).st_size
        if size != f.size:
            raise Refused(422, f"{up.name}: {rel} has {size} bytes, {f.size} were declared")
        with f.lock:
            gap = uncovered(f)
        if gap is not None:
            raise Refused(
                422, f"{up.name}: {rel}'s bytes {gap[0]}..{gap[1]} never arrived whole with a matching crc32"
            )
        _fsync(path)
    files = {
        rel: {"size": f.size, "chunks": [[at, *f.checked[at]] for at in sorted(f.checked)]}
        for rel, f in up.files.items()
    }
    derived, sums = derive(root, up) if up.base is not None else ({}, {})
    files = {rel: v for rel, v in files.items() if not rel.endswith(DELTA_SUFFIX) or up.base is None}
    if up.checksums:
        sums |= _checksums(up.staging, {*files, *derived} - set(sums))
    manifest = {"name": up.name, "upload": up.id, "committed_at": time.time(), "files": files}
    manifest |= {"base": up.base, "derived": derived, "checksums": sums}
    with open(os.path.join(up.staging, MANIFEST), "w") as out:
        json.dump(manifest, out, indent=1, sort_keys=True)
        out.flush()
        os.fsync(out.fileno())
    for folder, _, _ in os.walk(up.staging):
        _fsync(folder)
    return sums


def derive(root: str, up: Upload) -> tuple[dict[str, str], dict[str, int]]:
    """Complete the staging dir from the base version: each base file not uploaded is made from its
    delta (`X` + DELTA_SUFFIX, server/delta_file.py) or copied; the deltas and anything else not part
    of the version (a recycled dir's leftovers) are removed. ({file: "delta" or "copy"}, the checksums
    that follow from the base's manifest). A delta that does not apply is a 422 naming it."""
    from safetensors.torch import load_file

    from grpoflow.server import delta_file  # torch and safetensors: only for a version made from a base

    base_dir = os.path.join(root, up.base)
    base_files = _files_of(root, up.base)
    with open(os.path.join(base_dir, MANIFEST)) as f:
        known = json.load(f).get("checksums") or {}
    deltas = {rel for rel in up.files if rel.endswith(DELTA_SUFFIX)}
    if orphans := sorted(d for d in deltas if d.removesuffix(DELTA_SUFFIX) not in base_files):
        raise Refused(422, f"{up.name}: {orphans[0]} is a delta of a file the base {up.base} does not have")
    derived, sums = {}, {}
    for rel in base_files:
        if rel in up.files:
            continue
        src, out = os.path.join(base_dir, rel), os.path.join(up.staging, rel)
        os.makedirs(os.path.dirname(out), exist_ok=True)
        if rel + DELTA_SUFFIX in deltas:
            try:
                delta = load_file(os.path.join(up.staging, rel + DELTA_SUFFIX))
                change = delta_file.materialize(src, delta, out)
            except (ValueError, OSError) as e:
                raise Refused(422, f"{up.name}: {rel + DELTA_SUFFIX} does not apply to {up.base}: {e}") from e
            derived[rel] = "delta"
            if rel in known:
                sums[rel] = delta_file.wrap64(known[rel] + change)
        else:
            delta_file.copy_file(src, out)
            derived[rel] = "copy"
            if rel in known:
                sums[rel] = known[rel]
        _fsync(out)
    _keep_only(up.staging, (set(up.files) - deltas) | set(derived))
    return derived, sums


def _checksums(folder: str, files: set[str]) -> dict[str, int]:
    """server/delta.py's checksum of each safetensors file among `files` (a full pass over each)."""
    from grpoflow.server.delta_file import checksum_of  # torch: only when a client asks

    return {
        rel: checksum_of(os.path.join(folder, rel)) for rel in sorted(files) if rel.endswith(".safetensors")
    }


def publish(root: str, up: Upload) -> str:
    """Rename the verified staging dir to its name (a version already there is renamed aside, then
    deleted); its path."""
    target = os.path.join(root, up.name)
    aside = os.path.join(root, TRASH + up.id)
    with _rename_lock:
        check_target(root, up.name)
        os.makedirs(os.path.dirname(target), exist_ok=True)
        replaced = os.path.isdir(target)
        if replaced:
            os.rename(target, aside)
        try:
            os.rename(up.staging, target)
        except OSError:
            if replaced:  # the version it was to replace goes back
                os.rename(aside, target)
            raise
        _fsync(os.path.dirname(target))
    if replaced:
        shutil.rmtree(aside, ignore_errors=True)
    return target


def remove_version(root: str, name: str) -> str:
    """Delete the uploaded version `name` (a 404 for anything else); its path."""
    target = os.path.join(root, name)
    aside = os.path.join(root, TRASH + secrets.token_hex(12))
    with _rename_lock:
        if not os.path.isfile(os.path.join(target, MANIFEST)):
            raise Refused(404, f"no uploaded version {name!r} on this server")
        os.rename(target, aside)  # gone from its name at once; the files go next
    shutil.rmtree(aside, ignore_errors=True)
    return target


def versions(root: str) -> list[str]:
    """The names of the uploaded versions under `root`."""
    if not os.path.isdir(root):
        return []
    out = []
    for folder, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if not d.startswith(".")]
        if MANIFEST in files:
            out.append(os.path.relpath(folder, root).replace(os.sep, "/"))
            dirs[:] = []
    return sorted(out)


def _fsync(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)

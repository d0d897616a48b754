"""The upload directory of grpoflow_upload.WeightUpload (its module doc has the protocol): the names it
accepts, the staging dirs, the writes, and the check and publication of a version. Everything here
touches the disk, so the middleware calls it on a thread. Standard library only.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import secrets
import shutil
import threading
import time
from dataclasses import dataclass, field

MANIFEST = ".grpoflow-upload.json"  # in every committed version: what marks a dir as one
STAGING, TRASH = ".incoming-", ".trash-"
MAX_FILES, MAX_DEPTH, MAX_NAME = 10_000, 8, 1024
_HEX64 = re.compile(r"[0-9a-f]{64}")
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
    hasher: object = field(default_factory=hashlib.sha256)
    hashed: int = 0  # bytes [0, hashed) fed to `hasher` in order; -1 once a write broke the order
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


def digests(given, up: Upload) -> dict[str, str]:
    """{path: sha256} of a commit's "sha256", one for each declared file, else a 400."""
    if not isinstance(given, dict) or set(given) != set(up.files):
        raise Refused(
            400, f"commit needs {{'sha256': {{path: hex}}}} for exactly the {len(up.files)} declared files"
        )
    if bad := [p for p, d in given.items() if not isinstance(d, str) or not _HEX64.fullmatch(d.lower())]:
        raise Refused(400, f"{bad[0]}: sha256 must be 64 hex digits")
    return {p: d.lower() for p, d in given.items()}


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
    for folder, _, names in os.walk(up.staging, topdown=False):
        for n in names:
            rel = os.path.relpath(os.path.join(folder, n), up.staging).replace(os.sep, "/")
            if rel not in up.files:
                os.unlink(os.path.join(folder, n))
    return True


def write(up: Upload, rel: str, offset: int, data: bytes) -> None:
    """Write `data` at `offset`; the running digest follows only in-order writes."""
    f = up.files[rel]
    try:  # never O_CREAT: a write racing an abort finds its file gone instead of making it again
        fd = os.open(os.path.join(up.staging, rel), os.O_WRONLY)
    except FileNotFoundError:
        raise Refused(404, f"upload {up.id} ({up.name}) was aborted or superseded") from None
    try:
        view, at = memoryview(data), offset
        while view:
            n = os.pwrite(fd, view, at)
            view, at = view[n:], at + n
    finally:
        os.close(fd)
    with f.lock:
        if f.hashed == offset:
            f.hasher.update(data)
            f.hashed += len(data)
        else:
            f.hashed = -1


def verify(up: Upload, sha256: dict[str, str]) -> None:
    """Every file has its declared size and the sender's sha256 (a 422 naming it if not), and is
    on disk; then the manifest is written."""
    for rel, f in up.files.items():
        path = os.path.join(up.staging, rel)
        size = os.stat(path).st_size
        if size != f.size:
            raise Refused(422, f"{up.name}: {rel} has {size} bytes, {f.size} were declared")
        with f.lock:
            digest = f.hasher.hexdigest() if f.hashed == f.size else file_sha256(path)
        if digest != sha256[rel]:
            raise Refused(422, f"{up.name}: {rel}'s sha256 is {digest}, the sender's {sha256[rel]}")
        _fsync(path)
    files = {rel: {"size": f.size, "sha256": sha256[rel]} for rel, f in up.files.items()}
    manifest = {"name": up.name, "upload": up.id, "committed_at": time.time(), "files": files}
    with open(os.path.join(up.staging, MANIFEST), "w") as out:
        json.dump(manifest, out, indent=1, sort_keys=True)
        out.flush()
        os.fsync(out.fileno())
    for folder, _, _ in os.walk(up.staging):
        _fsync(folder)


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


def file_sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(8 << 20):
            h.update(chunk)
    return h.hexdigest()


def _fsync(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)

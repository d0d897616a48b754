"""Delta pushes, the learner's side (issue 59; `sync.delta`): a version goes to a server that holds the
one before it as the elements that changed, and the server makes the whole version from the two
(server/delta_file.py) and answers its checksum, which must equal the learner's.

A delta pays where an RL step leaves most weights' bits alone: bf16 (or f16) weights, of which a step at
an RL learning rate changes a few percent (BENCHMARKS.md, "What an RL step changes in bf16"). A float32
step changes every element, so float32 versions always go whole. `Deltas` makes each (base, version)
delta once, whatever the number of servers that take it, in `<run's weights>/.deltas/<version>-from-
<base>/`: every file of the version but its safetensors weights, which are there as `<file>.delta`
(server/delta.py's tensors). It keeps each version's checksum: computed over the file once (the run's
first version), then the base's plus the change each delta makes. `forget` drops what no later push can
use.

tasks/push/transport.py decides per server: a delta when the server holds this run's previous upload
(its name is the base), the version whole otherwise (its first load, a server that restarted or missed a
push, a delta the server refused); any checksum that differs from the learner's is an error.
"""

from __future__ import annotations

import contextlib
import mmap
import shutil
import threading
from pathlib import Path

from grpoflow.server.delta import delta_bytes, make_delta, wrap64
from grpoflow.server.delta_file import checksum_of, layout, tensor_view
from grpoflow.server.protocol import DELTA_SUFFIX
from grpoflow.tasks.push.weights import write_safetensors

DELTAS = ".deltas"
_WHOLE_FLOATS = {"F32", "F64"}  # a step changes every element: such a version goes whole
MAX_SHARE = 0.5  # a delta of more than this share of the weights' bytes: the version goes whole


class Deltas:
    """One run's deltas and checksums (the module doc); shared by every server's load (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._sums: dict[tuple[str, int], dict[str, int]] = {}  # (version dir, its mtime) -> checksums
        self._made: dict[tuple[str, str], Path | None] = {}  # (base dir, version dir) -> its delta dir

    def checksums(self, version_dir: str | Path) -> dict[str, int]:
        """{safetensors file: checksum} of the version in `version_dir` (the module doc)."""
        with self._lock:
            return dict(self._sums_locked(Path(version_dir)))

    def applies(self, version_dir: str | Path) -> bool:
        """Can the version in `version_dir` go as a delta: safetensors weights, none in float32."""
        weights = _weights(Path(version_dir))
        return bool(weights) and all(
            e["dtype"] not in _WHOLE_FLOATS for f in weights for e in layout(str(f))[0].values()
        )

    def delta(self, base_dir: str | Path, version_dir: str | Path) -> Path | None:
        """The dir to upload, with the committed base's name, for the version in `version_dir`, whose
        base's files are in `base_dir`; None when the version should go whole (the module doc)."""
        key = (str(base_dir), str(version_dir))
        with self._lock:
            if key not in self._made:
                self._made[key] = self._make(Path(base_dir), Path(version_dir))
            return self._made[key]

    def forget(self, version_dir: str | Path) -> None:
        """Drop every delta but those made for the version in `version_dir` (the newest)."""
        keep = Path(version_dir).name + "-from-"
        with self._lock:
            self._made = {k: v for k, v in self._made.items() if Path(k[1]).name + "-from-" == keep}
            folder = Path(version_dir).parent / DELTAS
            for d in folder.iterdir() if folder.is_dir() else []:
                if not d.name.startswith(keep):
                    shutil.rmtree(d, ignore_errors=True)

    def _make(self, base_dir: Path, version_dir: Path) -> Path | None:
        weights = _weights(version_dir)
        if not weights or any(not (base_dir / f.name).is_file() for f in weights):
            return None
        base_sums = self._sums_locked(base_dir)
        out = version_dir.parent / DELTAS / f"{version_dir.name}-from-{base_dir.name}"
        shutil.rmtree(out, ignore_errors=True)
        out.mkdir(parents=True)
        sums, total, sent = {}, 0, 0
        for f in weights:
            made = _file_delta(base_dir / f.name, f)
            if made is None:
                shutil.rmtree(out, ignore_errors=True)
                return None
            delta, change = made
            write_safetensors(delta, out / (f.name + DELTA_SUFFIX))
            sums[f.name] = wrap64(base_sums[f.name] + change)
            total, sent = total + f.stat().st_size, sent + delta_bytes(delta)
        if sent > MAX_SHARE * total:
            shutil.rmtree(out, ignore_errors=True)
            return None
        for f in version_dir.iterdir():  # the version's other files (config, marker) go as they are
            if f.is_file() and f not in weights:
                shutil.copyfile(f, out / f.name)
        self._sums[_key(version_dir)] = sums
        return out

    def _sums_locked(self, version_dir: Path) -> dict[str, int]:
        key = _key(version_dir)
        if key not in self._sums:
            self._sums[key] = {f.name: checksum_of(str(f)) for f in _weights(version_dir)}
        return self._sums[key]


def _key(version_dir: str | Path) -> tuple[str, int]:
    """A version dir as it is now: a dir recycled for another version has other contents and mtime."""
    files = _weights(Path(version_dir))
    return str(version_dir), max((f.stat().st_mtime_ns for f in files), default=0)


def _weights(version_dir: Path) -> list[Path]:
    return sorted(f for f in version_dir.glob("*.safetensors") if f.is_file())


def _file_delta(base: Path, new: Path) -> tuple[dict, int] | None:
    """make_delta of two safetensors files of one layout (names, dtypes, shapes); None when they differ
    or hold float32 weights."""
    (hb, sb), (hn, sn) = layout(str(base)), layout(str(new))
    same = {n: (e["dtype"], e["shape"]) for n, e in hb.items()} == {
        n: (e["dtype"], e["shape"]) for n, e in hn.items()
    }
    if not same or any(e["dtype"] in _WHOLE_FLOATS for e in hn.values()):
        return None
    with contextlib.ExitStack() as stack:
        maps = []
        for path in (base, new):
            f = stack.enter_context(open(path, "rb"))
            maps.append(stack.enter_context(mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)))
        old = {n: tensor_view(maps[0], e, sb) for n, e in hb.items()}
        now = {n: tensor_view(maps[1], e, sn) for n, e in hn.items()}
        delta, change = make_delta(old, now)  # its tensors are copies: none shares the maps
        del old, now
    return delta, change

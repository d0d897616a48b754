"""A version's safetensors file made from its base version's file and a delta (issue 59: a delta push
sends only the elements that changed; the server writes the whole new file, checks it against the
learner's checksum, and reloads it as it reloads any version).

A delta file is a safetensors file of delta.py's tensors: per weight `N`, either `N` (the whole
tensor, of the base's dtype and shape) or `N@idx` and `N@val` (flat indices and the new values). The
new file has the base file's layout byte for byte (header, order, offsets): `materialize` copies the base
file into the output (over its bytes in place when the output exists: a recycled version's file, whose
pages are written over rather than allocated again) and patches the changed elements through a memory
map, so its cost is one copy of the base and a scatter of the changes. A delta that would change the
layout (a new tensor, another dtype or shape) is refused with ValueError: the pusher sends that version
whole.

`checksum_of(path)` is delta.py's checksum of every tensor in a safetensors file, names as the file has
them; `materialize` returns the change the delta makes to it, computed from the values the base held,
so the new file's checksum is the base's plus that change, with no pass over the whole file.

Runs in vLLM's API server process (the upload middleware's commit, on a thread) and in the learner's:
torch and safetensors (grpoflow.server PROVIDED_BY_VLLM), imported by upload.py only for a delta.
"""

from __future__ import annotations

import json
import math
import mmap
import os
import struct

import torch

from grpoflow.server.delta import IDX, VAL, elements_change, raw_bits, tensor_checksum, wrap64

__all__ = ["SAFETENSORS_DTYPES", "checksum_of", "copy_file", "layout", "materialize", "tensor_view", "wrap64"]

SAFETENSORS_DTYPES = {  # safetensors' dtype names (the learner's writer, tasks/push/weights.py, too)
    "BF16": torch.bfloat16,
    "F16": torch.float16,
    "F32": torch.float32,
    "F64": torch.float64,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
_COPY_BLOCK = 16 << 20


def layout(path: str) -> tuple[dict[str, dict], int]:
    """A safetensors file's header entries (name -> dtype, shape, data_offsets; metadata left out) and
    where its data starts."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    header.pop("__metadata__", None)
    return header, 8 + n


def tensor_view(buf, entry: dict, start: int) -> torch.Tensor:
    """The tensor `entry` describes, flat, sharing the memory of `buf` (a writable mmap)."""
    lo, hi = entry["data_offsets"]
    dtype = SAFETENSORS_DTYPES[entry["dtype"]]
    count = (hi - lo) // dtype.itemsize
    if count == 0:
        return torch.empty(0, dtype=dtype)
    return torch.frombuffer(buf, dtype=dtype, count=count, offset=start + lo)


def checksum_of(path: str) -> int:
    """delta.py's checksum of every tensor in the safetensors file at `path`."""
    header, start = layout(path)
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY) as buf:
        total = sum(tensor_checksum(name, tensor_view(buf, e, start)) for name, e in header.items())
    return wrap64(total)


def copy_file(src: str, dst: str) -> None:
    """`src`'s bytes into `dst`, over an existing file's pages in place (then cut to length). The kernel
    copies (os.copy_file_range: no pass through user space, about half the time for SmolLM2's 270 MB in
    bf16 here: benchmarks/delta_copy.py); where it cannot (another filesystem on an old kernel, no such
    call), reads and writes."""
    with open(src, "rb") as i, open(dst, "r+b" if os.path.isfile(dst) else "wb") as o:
        size, done = os.fstat(i.fileno()).st_size, 0
        try:
            while done < size and (n := os.copy_file_range(i.fileno(), o.fileno(), size - done, done, done)):
                done += n
        except (AttributeError, OSError):  # copy_file_range's offsets move neither file's position
            pass
        i.seek(done)
        o.seek(done)
        while block := i.read(_COPY_BLOCK):
            o.write(block)
        o.truncate()


def materialize(base: str, delta: dict[str, torch.Tensor], out: str) -> int:
    """Write to `out` the file `base` with `delta` applied (the module doc); the change it made to the
    checksum. ValueError, naming the tensor, for a delta that does not fit the base's layout."""
    header, start = layout(base)
    _check(header, delta, base)
    copy_file(base, out)
    change = 0
    with open(out, "r+b") as f, mmap.mmap(f.fileno(), 0) as buf:
        for key, t in delta.items():
            if key.endswith(VAL):
                continue
            name = key[: -len(IDX)] if key.endswith(IDX) else key
            target = tensor_view(buf, header[name], start)
            if key.endswith(IDX):
                idx = t.to(torch.int64)
                values = delta[name + VAL].to(target.dtype)
                change += elements_change(name, idx, target[idx], values)
                target[idx] = values
            else:
                change += tensor_checksum(name, t) - tensor_checksum(name, target)
                raw_bits(target).copy_(raw_bits(t.reshape(-1)))
            del target  # no view may outlive the map
        buf.flush()
    return wrap64(change)


def _check(header: dict[str, dict], delta: dict[str, torch.Tensor], base: str) -> None:
    """ValueError unless every tensor of `delta` patches one of `base`'s in its dtype, shape and range."""
    for key, t in delta.items():
        if key.endswith(VAL):
            continue
        name = key[: -len(IDX)] if key.endswith(IDX) else key
        entry = header.get(name)
        if entry is None:
            raise ValueError(f"delta tensor {name!r} is not in the base file {base}: send the version whole")
        dtype, shape = SAFETENSORS_DTYPES[entry["dtype"]], entry["shape"]
        if key.endswith(IDX):
            values = delta.get(name + VAL)
            numel = math.prod(shape)
            if values is None or values.shape != t.shape or values.dtype != dtype:
                raise ValueError(
                    f"delta tensor {name!r}: {name + VAL} missing or not {len(t)} {dtype} values"
                )
            if t.numel() and not 0 <= int(t.min()) <= int(t.max()) < numel:
                raise ValueError(f"delta tensor {name!r}: indices outside its {numel} elements")
        elif t.dtype != dtype or list(t.shape) != shape:
            raise ValueError(
                f"delta tensor {name!r} is {t.dtype} {list(t.shape)}, the base file's {dtype} {shape}: "
                "send the version whole"
            )

"""Sparse weight deltas: the elements of a model's weights that changed between two versions, in the
dtype the servers run, and a checksum that both sides compute to agree on what is served (issue 59:
pushes that cost what changed; not yet wired into the push: tasks/push/ sends whole versions today).

A delta is a dict of tensors, per weight name N:
- `N`: the whole tensor (dense), when most of its elements changed or the base has no such tensor;
- `N@idx`, `N@val`: the flat indices (int32 where the tensor's size allows, ascending) of the elements
  whose bits changed, and their new values; a tensor goes whole when that would cost fewer bytes.
`make_delta` builds it from the base version's tensors and the new ones (both in the served dtype: a
bf16 element that rounds to the same bits is unchanged, which is why a bf16 delta of an RL step is
small and a float32 one is not); `apply_delta` applies it in place on top of the base and returns the
names it changed.

The checksum of a set of tensors is sum_i bits(x_i) * w(N, i) mod 2^64 over every element of every
tensor, bits() an element's bit pattern as a signed integer and w an odd hash of the tensor's name and
the element's flat index. Integer addition mod 2^64 is associative, so every summation order (torch's
parallel reductions included) gives the same value, and it is linear in the elements: the change a
delta makes to the checksum follows from the changed elements alone (`checksum_change`), so neither
side reads the whole model to check a delta. torch's int64 arithmetic wraps mod 2^64 on the CPU
(tests/unit/test_delta.py checks it against Python's integers).

Runs in the learner's environment and, imported by the worker extension's functions, in vLLM's: torch
only (grpoflow.server PROVIDED_BY_VLLM).
"""

from __future__ import annotations

import hashlib

import torch

IDX, VAL = "@idx", "@val"
_BITS = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_MIX = -7046029254386353131  # 0x9E3779B97F4A7C15 as a signed int64: an odd multiplier (Fibonacci hashing)
_CHUNK = 1 << 22  # elements per step of a checksum (bounds its int64 temporaries to 32 MB)


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The elements' bit patterns as int64 (a float's bits, an integer's value), flat."""
    return raw_bits(t).to(torch.int64)


def raw_bits(t: torch.Tensor) -> torch.Tensor:
    """The elements' bit patterns in their own width (a float's bits as the same-size integer), flat."""
    flat = t.detach().reshape(-1)
    return flat.view(_BITS[flat.element_size()]) if flat.dtype.is_floating_point else flat


def _seed(name: str) -> int:
    """A signed 64-bit hash of a tensor's name (its checksum weights differ from every other tensor's)."""
    return int.from_bytes(hashlib.blake2b(name.encode(), digest_size=8).digest(), "little", signed=True)


def _weights(name: str, idx: torch.Tensor) -> torch.Tensor:
    """w(name, i) for the flat indices `idx`: odd, so no element's change can vanish from the sum."""
    return ((idx + _seed(name)) * _MIX) | 1


def wrap64(x: int) -> int:
    return (x + (1 << 63)) % (1 << 64) - (1 << 63)


def tensor_checksum(name: str, t: torch.Tensor) -> int:
    """One tensor's share of `checksum` (a signed 64-bit integer)."""
    raw, seed, total = raw_bits(t), _seed(name), 0
    for lo in range(0, raw.numel(), _CHUNK):  # int64 temporaries of one chunk at a time
        part = raw[lo : lo + _CHUNK].to(torch.int64)
        w = torch.arange(lo, lo + part.numel(), dtype=torch.int64).add_(seed).mul_(_MIX).bitwise_or_(1)
        total += int(part.mul_(w).sum())
    return wrap64(total)


def _whole_change(name: str, new: torch.Tensor, old: torch.Tensor | None) -> int:
    """What replacing tensor `name` (`old`, None: absent) with `new` changes in the checksum."""
    return tensor_checksum(name, new) - (tensor_checksum(name, old) if old is not None else 0)


def elements_change(name: str, idx: torch.Tensor, was: torch.Tensor, now: torch.Tensor) -> int:
    """What the elements at flat indices `idx` changing from `was` to `now` change in the checksum."""
    return int(((_bits(now) - _bits(was)) * _weights(name, idx)).sum())


def checksum(tensors: dict[str, torch.Tensor]) -> int:
    """The checksum of a set of named tensors (the module doc), as a signed 64-bit integer."""
    return wrap64(sum(tensor_checksum(n, t) for n, t in tensors.items()))


def make_delta(
    base: dict[str, torch.Tensor], new: dict[str, torch.Tensor]
) -> tuple[dict[str, torch.Tensor], int]:
    """The delta that turns `base` into `new` (same names; each tensor's elements compared bit for bit),
    and the change it makes to the checksum. An unchanged tensor is left out."""
    out: dict[str, torch.Tensor] = {}
    change = 0
    for name, t in new.items():
        old = base.get(name)
        if old is None or old.shape != t.shape or old.dtype != t.dtype:
            out[name] = t.detach().clone()
            change += _whole_change(name, t, old)
            continue
        now, was = raw_bits(t), raw_bits(old)  # compared in their own width: no int64 copy of the model
        idx = torch.nonzero(now != was).reshape(-1)
        if idx.numel() == 0:
            continue
        change += elements_change(name, idx, was[idx], now[idx])
        small = now.numel() < 2**31
        if idx.numel() * ((4 if small else 8) + t.element_size()) >= now.numel() * t.element_size():
            out[name] = t.detach().clone()  # cheaper whole
        else:
            vals = t.detach().reshape(-1)[idx].clone()
            out[name + IDX], out[name + VAL] = idx.to(torch.int32) if small else idx, vals
    return out, wrap64(change)


def apply_delta(base: dict[str, torch.Tensor], delta: dict[str, torch.Tensor]) -> tuple[list[str], int]:
    """Apply `delta` to `base` in place (a dense tensor replaces the base's); the names it changed and
    the change it made to the checksum, computed from the values `base` held, not from the sender's."""
    names, change = [], 0
    for key, t in delta.items():
        if key.endswith(VAL):
            continue
        if key.endswith(IDX):
            name = key[: -len(IDX)]
            target, values = base[name], delta[name + VAL]
            flat = target.view(-1)
            idx = t.to(torch.int64)
            change += elements_change(name, idx, flat[idx], values)
            flat[idx] = values.to(target.dtype)
        else:
            name = key
            old = base.get(name)
            change += _whole_change(name, t, old)
            if old is not None and old.shape == t.shape and old.dtype == t.dtype:
                old.copy_(t)
            else:
                base[name] = t.clone()
        names.append(name)
    return names, wrap64(change)


def delta_bytes(delta: dict[str, torch.Tensor]) -> int:
    """What the delta's tensors weigh, indices included."""
    return sum(t.numel() * t.element_size() for t in delta.values())

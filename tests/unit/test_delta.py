"""Sparse weight deltas (server/delta.py): what an RL-sized step changes in bf16, applied on top of its
base, and a checksum that follows a delta from the changed elements alone."""

from __future__ import annotations

import pytest
import torch

from grpoflow.server.delta import IDX, VAL, apply_delta, checksum, delta_bytes, make_delta

pytestmark = pytest.mark.unit


def _model(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"embed": torch.randn(64, 32, generator=g), "layer.q": torch.randn(32, 32, generator=g),
            "norm": torch.ones(32)}  # fmt: skip


def _step(master: dict[str, torch.Tensor], lr: float, seed: int = 1) -> None:
    """One AdamW-sized update of the float32 masters: every element moves by about `lr`."""
    g = torch.Generator().manual_seed(seed)
    for t in master.values():
        t.add_(torch.randn(t.shape, generator=g).sign() * lr)


def _bf16(master):
    return {n: t.to(torch.bfloat16) for n, t in master.items()}


def _same(a: int, b: int) -> bool:
    """Equal as checksums: modulo 2^64."""
    return (a - b) % 2**64 == 0


def test_torch_int64_arithmetic_wraps_as_the_checksum_needs():
    big = torch.full((1000,), 2**62 + 7, dtype=torch.int64)
    assert int(big.sum()) == (1000 * (2**62 + 7) + 2**63) % 2**64 - 2**63
    assert int((big * 5).sum()) == (5000 * (2**62 + 7) + 2**63) % 2**64 - 2**63


def test_a_bf16_delta_of_a_small_step_is_small_and_rebuilds_the_new_weights_bit_for_bit():
    master = _model()
    base = _bf16(master)
    _step(master, lr=1e-5)
    new = _bf16(master)
    delta, change = make_delta(base, new)
    full = sum(t.numel() * t.element_size() for t in new.values())
    assert delta_bytes(delta) < 0.2 * full  # most bf16 values did not move at lr 1e-5
    assert not any(k.startswith("norm") for k in delta)  # 1 +- 1e-5 rounds back to 1.0 in bf16
    served = {n: t.clone() for n, t in base.items()}
    names, applied = apply_delta(served, delta)
    assert all(torch.equal(served[n].view(torch.int16), new[n].view(torch.int16)) for n in new)
    assert sorted(names) == ["embed", "layer.q"] and applied == change
    assert _same(checksum(base) + change, checksum(new))


def test_a_float32_delta_of_the_same_step_is_dense():
    master = _model()
    base = {n: t.clone() for n, t in master.items()}
    _step(master, lr=1e-5)
    delta, _ = make_delta(base, master)
    assert set(delta) == set(master)  # every element moved: each tensor goes whole


def test_the_checksum_sees_any_change_and_the_server_computes_it_from_what_it_holds():
    base = _bf16(_model())
    new = {n: t.clone() for n, t in base.items()}
    new["layer.q"].view(-1)[17] = torch.tensor(0.5, dtype=torch.bfloat16)
    delta, change = make_delta(base, new)
    assert list(delta) == ["layer.q" + IDX, "layer.q" + VAL] and delta["layer.q" + IDX].tolist() == [17]
    assert checksum(new) != checksum(base)
    # a server whose base differs where the delta writes ends with other weights and another checksum
    drifted = {n: t.clone() for n, t in base.items()}
    drifted["layer.q"].view(-1)[17] = torch.tensor(-3.0, dtype=torch.bfloat16)
    _, server_change = apply_delta(drifted, delta)
    assert server_change != change
    # ... and one that drifted elsewhere keeps its own checksum's offset: the totals disagree
    other = {n: t.clone() for n, t in base.items()}
    other["embed"].view(-1)[3] += 1
    before = checksum(other)
    _, c = apply_delta(other, delta)
    assert _same(before + c, checksum(other)) and checksum(other) != checksum(new)
    # swapping two elements changes it too (the weights depend on the index)
    swapped = {n: t.clone() for n, t in base.items()}
    q = swapped["layer.q"].view(-1)
    q[0], q[1] = base["layer.q"].view(-1)[1], base["layer.q"].view(-1)[0]
    assert checksum(swapped) != checksum(base)


def test_new_or_reshaped_tensors_go_whole():
    base = _bf16(_model())
    new = dict(base, extra=torch.ones(3, dtype=torch.bfloat16), norm=torch.ones(16, dtype=torch.bfloat16))
    delta, change = make_delta(base, new)
    assert set(delta) == {"extra", "norm"}
    served = {n: t.clone() for n, t in base.items()}
    _, applied = apply_delta(served, delta)
    assert applied == change and _same(checksum(base) + change, checksum(new))
    assert torch.equal(served["norm"], new["norm"]) and "extra" in served


def test_the_full_checksum_is_the_sum_the_incremental_one_updates():
    """`tensor_checksum` (chunked, in place) and the per-element weights a delta's change is computed
    with are one function: a chunk boundary or a signed bit pattern must not tell them apart."""
    import grpoflow.server.delta as d

    t = torch.randn(3000).to(torch.bfloat16)
    bits = t.view(torch.int16).to(torch.int64)
    by_element = int((bits * d._weights("layer.q", torch.arange(3000))).sum())
    old = d._CHUNK
    try:
        d._CHUNK = 1024  # three chunks, the last one short
        assert _same(d.tensor_checksum("layer.q", t), by_element)
    finally:
        d._CHUNK = old
    assert _same(d.tensor_checksum("layer.q", t), by_element)
    assert not _same(d.tensor_checksum("layer.k", t), by_element)  # the name is in the weights


# -- a version's file made from its base's file and a delta (server/delta_file.py) ---------------------


def _file(tmp_path, name: str, tensors: dict[str, torch.Tensor]):
    from grpoflow.tasks.push.weights import write_safetensors

    path = tmp_path / name
    write_safetensors(tensors, path)
    return path


def test_a_file_made_from_its_base_and_a_delta_is_the_new_version_byte_for_byte(tmp_path):
    from grpoflow.server.delta_file import checksum_of, materialize

    master = _model()
    base = dict(_bf16(master), steps=torch.tensor([3], dtype=torch.int64))  # a non-float tensor stays
    _step(master, lr=1e-5)
    new = dict(_bf16(master), steps=base["steps"])
    new["norm"] = torch.full((32,), 2.0, dtype=torch.bfloat16)  # one tensor whole
    delta, change = make_delta(base, new)
    assert "norm" in delta and "embed" + IDX in delta
    base_file, want = _file(tmp_path, "base.safetensors", base), _file(tmp_path, "want.safetensors", new)
    out = tmp_path / "out.safetensors"
    made = materialize(str(base_file), delta, str(out))
    assert out.read_bytes() == want.read_bytes()
    assert made == change and _same(checksum_of(str(base_file)) + made, checksum_of(str(out)))
    assert _same(checksum_of(str(out)), checksum(new))  # the learner's checksum of what it holds
    # over a recycled version's file, longer than the new one: written over in place, cut to length
    out.write_bytes(b"\xff" * (want.stat().st_size + 4096))
    materialize(str(base_file), delta, str(out))
    assert out.read_bytes() == want.read_bytes()


def test_a_delta_that_does_not_fit_the_base_file_is_refused_and_writes_nothing(tmp_path):
    from grpoflow.server.delta_file import materialize

    base = _bf16(_model())
    base_file = _file(tmp_path, "base.safetensors", base)
    out = tmp_path / "out.safetensors"
    cases = {
        "'extra' is not in the base file": {"extra": torch.ones(3, dtype=torch.bfloat16)},
        r"'norm' is torch.bfloat16 \[16\]": {"norm": torch.ones(16, dtype=torch.bfloat16)},
        r"'norm' is torch.float32 \[32\]": {"norm": torch.ones(32)},
        "'layer.q': indices outside": {
            "layer.q" + IDX: torch.tensor([5, 1024], dtype=torch.int32),
            "layer.q" + VAL: torch.ones(2, dtype=torch.bfloat16),
        },
        r"'layer.q': layer.q@val missing": {"layer.q" + IDX: torch.tensor([5], dtype=torch.int32)},
    }
    for message, delta in cases.items():
        with pytest.raises(ValueError, match=message):
            materialize(str(base_file), delta, str(out))
        assert not out.exists(), message


@pytest.mark.parametrize("kernel", ["copies", "stops half way", "has no such call"])
def test_a_file_copied_over_a_longer_one_is_the_source_however_the_kernel_copies(
    tmp_path, monkeypatch, kernel
):
    """copy_file: os.copy_file_range where it works; where it stops (EXDEV, ENOSYS) or is missing, the
    rest by reads and writes. Either way the old file's tail is cut."""
    import errno
    import os

    from grpoflow.server import delta_file

    src, dst = tmp_path / "src", tmp_path / "dst"
    src.write_bytes(torch.randint(0, 256, (3 << 20 | 77,), dtype=torch.uint8).numpy().tobytes())
    dst.write_bytes(b"\xff" * (5 << 20))
    real = os.copy_file_range
    calls = []

    def half_then_fails(i, o, count, offset_src, offset_dst):
        calls.append(count)
        if len(calls) > 1:
            raise OSError(errno.EXDEV, "Invalid cross-device link")
        return real(i, o, count // 2, offset_src, offset_dst)

    if kernel == "stops half way":
        monkeypatch.setattr(os, "copy_file_range", half_then_fails)
    elif kernel == "has no such call":
        monkeypatch.delattr(os, "copy_file_range")
    delta_file.copy_file(str(src), str(dst))
    assert dst.read_bytes() == src.read_bytes()
    assert len(calls) == (2 if kernel == "stops half way" else 0)

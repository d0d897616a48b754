"""A version made on the server from its base and a delta (issue 59): grpoflow's upload middleware
(grpoflow.server.upload, called as vLLM runs it) completing an upload from a committed version, and
the checksums its commit answers."""

from __future__ import annotations

import json

import pytest
import torch

from grpoflow.server.delta import checksum, make_delta
from grpoflow.server.protocol import MANIFEST
from grpoflow.tasks.push.weights import write_safetensors
from tests.unit import test_upload
from tests.unit.test_upload import call, commit, inner, listing, put

pytestmark = pytest.mark.unit
mod = test_upload.mod  # the middleware's module, uploads under <tmp>/uploads (a fixture)


def _weights(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"embed": torch.randn(64, 32, generator=g).to(torch.bfloat16), "norm": torch.ones(32).bfloat16()}


def _stepped(w: dict[str, torch.Tensor], n: int) -> dict[str, torch.Tensor]:
    """`w` with `n` elements of its embedding changed: a small step's bf16 weights."""
    out = {k: t.clone() for k, t in w.items()}
    out["embed"].view(-1)[:n] += 1
    return out


def _bytes(tmp_path, tensors: dict[str, torch.Tensor]) -> bytes:
    path = tmp_path / "w.safetensors"
    write_safetensors(tensors, path)
    return path.read_bytes()


def send(app, name: str, files: dict[str, bytes], **fields):
    """Create (with `fields`: base, recycle, checksums), PUT each file whole, commit: (status, answer)."""
    body = {"name": name, "files": [{"path": p, "size": len(b)} for p, b in files.items()], **fields}
    status, out = call(app, "POST", "/grpoflow/uploads", body)
    if status != 200:
        return status, out
    for p, b in files.items():
        assert put(app, out["upload"], p, b)[0] == 200
    return commit(app, out["upload"])


def test_a_version_made_from_its_base_and_a_delta_is_the_new_version_with_its_checksum(mod, tmp_path):
    app, root = mod.WeightUpload(inner), tmp_path / "uploads"
    v1 = _weights(0)
    status, out = send(app, "r/v000001", {"model.safetensors": _bytes(tmp_path, v1), "config.json": b"{1}"},
                       checksums=True)  # fmt: skip
    assert status == 200 and out["checksums"] == {"model.safetensors": checksum(v1)}
    for step, n in enumerate([5, 40], start=2):
        v2 = _stepped(v1, n)
        delta, _ = make_delta(v1, v2)
        delta_file = _bytes(tmp_path, delta)
        assert len(delta_file) < 0.2 * len(_bytes(tmp_path, v2))
        status, out = send(app, f"r/v{step:06d}", {"model.safetensors.delta": delta_file},
                           base=f"r/v{step - 1:06d}")  # fmt: skip
        assert status == 200, out
        made = root / "r" / f"v{step:06d}"
        assert (made / "model.safetensors").read_bytes() == _bytes(tmp_path, v2)
        assert (made / "config.json").read_bytes() == b"{1}"  # carried over from the base
        assert sorted(p.name for p in made.iterdir()) == sorted(
            [MANIFEST, "config.json", "model.safetensors"]
        )
        # the checksum follows from the base's and the changed elements: no pass over the whole file
        assert out["checksums"] == {"model.safetensors": checksum(v2)}
        manifest = json.loads((made / MANIFEST).read_text())
        assert (
            manifest["base"] == f"r/v{step - 1:06d}" and manifest["derived"]["model.safetensors"] == "delta"
        )
        v1 = v2


def test_a_version_made_over_a_recycled_one_keeps_only_its_own_files(mod, tmp_path):
    app, root = mod.WeightUpload(inner), tmp_path / "uploads"
    v1 = _weights(0)
    assert send(app, "r/v000001", {"model.safetensors": _bytes(tmp_path, v1), "config.json": b"{}"},
                checksums=True)[0] == 200  # fmt: skip
    assert (
        send(app, "r/v000000", {"model.safetensors": _bytes(tmp_path, _weights(1)), "old.txt": b"x"})[0]
        == 200
    )
    v2 = _stepped(v1, 3)
    status, out = send(app, "r/v000002", {"model.safetensors.delta": _bytes(tmp_path, make_delta(v1, v2)[0])},
                       base="r/v000001", recycle="r/v000000")  # fmt: skip
    assert status == 200, out
    assert (root / "r" / "v000002" / "model.safetensors").read_bytes() == _bytes(tmp_path, v2)
    assert not (root / "r" / "v000002" / "old.txt").exists()  # the recycled dir's leftover
    assert not (root / "r" / "v000000").exists() and out["checksums"]["model.safetensors"] == checksum(v2)


def test_a_delta_that_does_not_apply_or_a_missing_base_publishes_nothing(mod, tmp_path):
    app, root = mod.WeightUpload(inner), tmp_path / "uploads"
    v1 = _weights(0)
    assert send(app, "r/v000001", {"model.safetensors": _bytes(tmp_path, v1)})[0] == 200
    before = listing(root / "r")
    status, out = send(app, "r/v000002", {"model.safetensors.delta": b"{}"}, base="r/v000009")
    assert status == 404 and "base 'r/v000009'" in out["error"]
    wrong = {"embed": torch.ones(3, dtype=torch.bfloat16)}  # another shape: it cannot patch the file
    status, out = send(
        app, "r/v000002", {"model.safetensors.delta": _bytes(tmp_path, wrong)}, base="r/v000001"
    )
    assert status == 422 and "model.safetensors.delta does not apply to r/v000001" in out["error"]
    assert "'embed'" in out["error"]
    status, out = send(app, "r/v000002", {"tokenizer.json.delta": b"x"}, base="r/v000001")
    assert status == 422 and "tokenizer.json.delta is a delta of a file the base" in out["error"]
    status, out = send(app, "r/v000002", {"a": b"x"}, base="r/v000002")
    assert status == 400 and "made from itself" in out["error"]
    assert listing(root / "r") == before  # the base untouched, no new version, no staging left
    assert not [p for p in root.iterdir() if p.name.startswith(".")]

"""Delta pushes over the network (tasks/push/delta_push.py, tasks/push/transport.py): versions after the
first go to a server that holds the one before as what changed, the server makes each whole and its
checksum is the learner's; a server that lost its base, or whose base was changed, gets the version whole.
Against grpoflow's upload middleware served by uvicorn (the fake vLLM behind it is test_upload.py's);
the real server is tests/integration/test_hosts_push.py's. `sync.delta: auto`'s choice by cost (DeltaCosts)
is at the end."""

from __future__ import annotations

import json
import logging

import pytest
import torch

from grpoflow.server.delta import checksum
from grpoflow.tasks.push.delta_push import Deltas
from grpoflow.tasks.push.transport import DeltaCosts, Transport
from grpoflow.tasks.push.weights import write_safetensors
from tests.unit import test_upload
from tests.unit.test_transport import on
from tests.unit.test_upload import inner, served

pytestmark = pytest.mark.unit
mod = test_upload.mod  # the middleware's module, uploads under <tmp>/uploads (a fixture)


def _version(tmp_path, v: int, tensors: dict[str, torch.Tensor]):
    d = tmp_path / "weights" / "r" / f"v{v:06d}"
    d.mkdir(parents=True, exist_ok=True)
    write_safetensors(tensors, d / "model.safetensors")
    (d / "config.json").write_text(json.dumps({"v": v}))
    return d


def _steps(n: int, dtype=torch.bfloat16):
    """`n` versions of a model, each a small step from the one before (a few elements change in bf16)."""
    g = torch.Generator().manual_seed(0)
    w = {"embed": torch.randn(256, 64, generator=g), "norm": torch.ones(64)}
    out = []
    for _ in range(n):
        out.append({k: t.to(dtype) for k, t in w.items()})
        w["embed"].view(-1)[torch.randint(0, w["embed"].numel(), (50,), generator=g)] += 0.5
    return out


def test_versions_after_the_first_go_as_deltas_and_the_server_holds_each_bit_for_bit(mod, tmp_path):
    t = Transport("r", "network", recycle=2, deltas=Deltas())
    versions = _steps(4)
    with served(mod.WeightUpload(inner)) as url:
        sent = []
        for v, w in enumerate(versions, start=1):
            path = _version(tmp_path, v, w)
            sent.append(on(url, lambda c, v=v, path=path: t.deliver(c, str(path), v)))
            served_file = tmp_path / "uploads" / "r" / f"v{v:06d}" / "model.safetensors"
            assert served_file.read_bytes() == (path / "model.safetensors").read_bytes()
            assert (served_file.parent / "config.json").read_text() == json.dumps({"v": v})
            assert t.deltas.checksums(path) == {"model.safetensors": checksum(w)}
            t.deltas.forget(path)
    assert [s.delta for s in sent] == [False, True, True, True]
    full = sent[0].bytes
    assert all(s.bytes < 0.1 * full for s in sent[1:]), [s.bytes for s in sent]
    # only the newest version's delta is kept on the learner
    assert [d.name for d in (tmp_path / "weights/r/.deltas").iterdir()] == ["v000004-from-v000003"]


def test_a_server_that_lost_its_base_or_holds_other_bytes_gets_the_version_whole(mod, tmp_path, caplog):
    t = Transport("r", "network", deltas=Deltas())
    v1, v2, v3 = _steps(3)
    with served(mod.WeightUpload(inner)) as url:
        on(url, lambda c: t.deliver(c, str(_version(tmp_path, 1, v1)), 1))
        on(url, lambda c: c.delete_uploaded_version("r/v000001"))  # its disk lost it (a new replica)
        sent = on(url, lambda c: t.deliver(c, str(_version(tmp_path, 2, v2)), 2))
        assert not sent.delta
        # another process of the run (one killed, then resumed) sent another v2 since: the name is the
        # base's, the bytes are not the learner's, and the version made from it has another checksum
        other = Transport("r", "network", deltas=Deltas())
        elsewhere = _version(tmp_path / "elsewhere", 2, _steps(2)[0] | {"norm": torch.zeros(64).bfloat16()})
        on(url, lambda c: other.deliver(c, str(elsewhere), 2))
        with caplog.at_level(logging.WARNING, logger="grpoflow.tasks.push.transport"):
            sent = on(url, lambda c: t.deliver(c, str(_version(tmp_path, 3, v3)), 3))
    assert not sent.delta  # sent whole after the mismatch
    assert "made r/v000003 from r/v000002 with checksums" in caplog.text
    served_file = tmp_path / "uploads/r/v000003/model.safetensors"
    assert served_file.read_bytes() == (tmp_path / "weights/r/v000003/model.safetensors").read_bytes()


def test_float32_versions_always_go_whole(mod, tmp_path):
    t = Transport("r", "network", deltas=Deltas())
    with served(mod.WeightUpload(inner)) as url:
        sent = [
            on(url, lambda c, v=v, w=w: t.deliver(c, str(_version(tmp_path, v, w)), v))
            for v, w in enumerate(_steps(2, torch.float32), start=1)
        ]
    assert [s.delta for s in sent] == [False, False]
    assert not (tmp_path / "weights/r/.deltas").exists()


def test_a_server_that_answers_no_checksums_gets_every_version_whole(mod, tmp_path, monkeypatch):
    """A server of an older grpoflow ignores `checksums` and `base`: it must never be sent a delta, which
    it would publish as a version without its weights."""
    t = Transport("r", "network", deltas=Deltas())
    monkeypatch.setattr(mod.store, "_checksums", lambda folder, files: {})  # its commit answers none
    with served(mod.WeightUpload(inner)) as url:
        sent = [
            on(url, lambda c, v=v, w=w: t.deliver(c, str(_version(tmp_path, v, w)), v))
            for v, w in enumerate(_steps(3), start=1)
        ]
    assert [s.delta for s in sent] == [False, False, False]
    for v in (1, 2, 3):
        mine = tmp_path / "weights/r" / f"v{v:06d}" / "model.safetensors"
        assert (tmp_path / "uploads/r" / f"v{v:06d}" / "model.safetensors").read_bytes() == mine.read_bytes()


def test_auto_keeps_deltas_while_they_cost_less_and_retries_one_after_wholes():
    """`sync.delta: auto` (DeltaCosts), seconds given: a delta until one took longer than the last whole
    version, then whole versions, every `retry_every`-th a delta again; each server on its own."""
    costs = DeltaCosts(retry_every=3)
    a, b = "http://a", "http://b"
    assert costs.want_delta(a)  # nothing measured: a delta wherever one applies
    costs.record(a, False, 2.0)
    costs.record(a, True, 1.0)
    assert costs.want_delta(a)  # the delta cost less
    costs.record(a, True, 3.0)
    assert not costs.want_delta(a)  # it cost more than the whole version
    assert not costs.want_base(a)  # and no delta follows the next one: it need not be checked
    costs.record(a, False, 2.0)
    assert not costs.want_delta(a)
    assert costs.want_base(a)  # the retry's base
    costs.record(a, False, 2.0)
    assert costs.want_delta(a)  # the third since: a delta again
    assert costs.want_delta(b)  # another server's costs are its own
    costs.record(a, True, 1.5)
    assert costs.want_delta(a)  # and it paid this time


def test_auto_sends_versions_whole_after_a_delta_that_cost_more(mod, tmp_path):
    """Through the transport: a delta's cost (given, not measured: the test must not depend on the clock)
    above the whole versions' sends the next versions whole until the retry's delta, only the one before
    the retry checked on the server (the retry's base)."""
    costs = DeltaCosts(retry_every=3)
    t = Transport("r", "network", recycle=2, deltas=Deltas(), delta_costs=costs)
    with served(mod.WeightUpload(inner)) as url:
        sent, checked = [], []
        for v, w in enumerate(_steps(4), start=1):
            path = _version(tmp_path, v, w)
            sent.append(on(url, lambda c, v=v, path=path: t.deliver(c, str(path), v)))
            if v == 1:
                costs.record(url, True, 1e9)  # as if a delta to this server had taken that long
            served_file = tmp_path / "uploads" / "r" / f"v{v:06d}" / "model.safetensors"
            assert served_file.read_bytes() == (path / "model.safetensors").read_bytes()
            t.deltas.forget(path)
            manifest = json.loads((served_file.parent / ".grpoflow-upload.json").read_text())
            checked.append(bool(manifest["checksums"]))
    assert [s.delta for s in sent] == [False, False, False, True]
    # v2 went whole unchecked (no delta would follow it: no full pass on the server); v3, the retry's
    # base, checked; v4, the delta, checked as every delta is
    assert checked == [True, False, True, True]

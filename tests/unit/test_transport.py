"""How a version reaches a server (tasks/push/transport.py): the probe route of grpoflow's upload
middleware, the choice of each server's transport, uploads and their retention, against the middleware
served by uvicorn (the fake vLLM behind it is test_upload.py's). Whether a server's host can read the
learner's files is real here (one host: it can); a host that cannot is faked by a probe that reads
nothing, named FAKE where used. The real second host is tests/integration/test_hosts_push.py."""

from __future__ import annotations

import asyncio
import hashlib
import os

import pytest

from grpoflow.tasks.push.transport import NETWORK, PATH, Transport, TransportError
from grpoflow.tasks.rollouts.inference import VLLMClient
from tests.unit.test_upload import KEY, call, inner, mod, served, stacked_as_served  # noqa: F401

pytestmark = pytest.mark.unit


@pytest.fixture
def plugin(mod):  # noqa: F811
    """test_upload.py's `mod`: the upload middleware's module, uploads going to <tmp>/uploads."""
    return mod


async def not_found(scope, receive, send):
    """A vLLM without grpoflow's plugin: 404 for grpoflow's routes."""
    await send({"type": "http.response.start", "status": 404, "headers": [(b"content-length", b"2")]})
    await send({"type": "http.response.body", "body": b"{}"})


def version(tmp_path, v: int, size: int = 70_000):
    d = tmp_path / "weights" / "r" / f"v{v:06d}"
    d.mkdir(parents=True)
    (d / "config.json").write_bytes(b"{}")
    (d / "model.safetensors").write_bytes(os.urandom(size))
    return d


def on(url, coro_fn, **client):
    async def go():
        async with VLLMClient(url, **client) as c:
            return await coro_fn(c)

    return asyncio.run(go())


def test_the_probe_reads_only_probe_files_and_says_whether_uploads_are_on(plugin, tmp_path, monkeypatch):
    app = plugin.WeightUpload(inner)
    probe = tmp_path / (".grpoflow-probe-" + "a" * 32)
    probe.write_bytes(b"token")
    assert call(app, "POST", "/grpoflow/probe", {"path": str(probe)}) == (
        200, {"sha256": hashlib.sha256(b"token").hexdigest(), "uploads": True})  # fmt: skip
    probe.write_bytes(b"x" * 65)  # longer than any probe: not read
    assert call(app, "POST", "/grpoflow/probe", {"path": str(probe)})[1]["sha256"] is None
    missing = tmp_path / (".grpoflow-probe-" + "b" * 32)
    assert call(app, "POST", "/grpoflow/probe", {"path": str(missing)})[1]["sha256"] is None
    for bad in (
        str(tmp_path / "secret"),
        ".grpoflow-probe-" + "a" * 32,
        str(tmp_path / ".grpoflow-probe-zz"),
    ):
        status, err = call(app, "POST", "/grpoflow/probe", {"path": bad})
        assert status == 400 and "field 'path'" in err["error"], bad
    monkeypatch.delenv("GRPOFLOW_UPLOAD_DIR")  # uploads off: the probe still answers
    assert call(plugin.WeightUpload(inner), "POST", "/grpoflow/probe", {"path": str(missing)}) == (
        200, {"sha256": None, "uploads": False})  # fmt: skip
    monkeypatch.setenv("VLLM_API_KEY", KEY)
    guarded = stacked_as_served(plugin)  # a server with a key: the probe needs it too
    assert call(guarded, "POST", "/grpoflow/probe", {"path": str(missing)})[0] == 401
    assert call(guarded, "POST", "/grpoflow/probe", {"path": str(missing)}, auth=f"Bearer {KEY}")[0] == 200


def test_auto_sends_the_path_to_a_host_that_reads_it_and_the_bytes_to_one_that_cannot(
    plugin,
    tmp_path,
    monkeypatch,
):
    v1 = version(tmp_path, 1)
    with served(plugin.WeightUpload(inner)) as url:
        sent = on(url, lambda c: Transport("r", "auto").deliver(c, str(v1), 1))
        assert sent.transport == PATH and sent.path == str(v1) and sent.bytes == 0
        assert not [p for p in v1.parent.iterdir() if p.name.startswith(".grpoflow-probe-")]  # removed

        async def reads_nothing(req):  # FAKE: a server whose host cannot see the learner's disk
            return None

        monkeypatch.setattr(plugin, "_probe", reads_nothing)
        t = Transport("r", "auto")
        sent = on(url, lambda c: t.deliver(c, str(v1), 1))
    assert sent.transport == NETWORK and sent.path == str(tmp_path / "uploads" / "r" / "v000001")
    assert sent.bytes == 70_002 and sent.seconds > 0 and t.chosen() == {url: NETWORK}
    for f in ("config.json", "model.safetensors"):
        assert (tmp_path / "uploads/r/v000001" / f).read_bytes() == (v1 / f).read_bytes()


def test_a_transport_a_server_cannot_take_is_refused_naming_the_field_and_the_server(
    plugin,
    tmp_path,
    monkeypatch,
):
    v1 = version(tmp_path, 1)

    def choose(url, mode):
        return on(url, lambda c: Transport("r", mode).choose(c, str(v1)))

    with served(not_found) as url:  # no grpoflow plugin: it cannot be asked, so 'path' as always
        assert choose(url, "auto") == PATH and choose(url, "path") == PATH
        with pytest.raises(
            TransportError, match="sync.transport is 'network' but .* has no grpoflow upload route"
        ):
            choose(url, "network")
    with served(plugin.WeightUpload(inner)) as url:
        assert choose(url, "network") == NETWORK  # it could read the path, but was told otherwise
        monkeypatch.delenv("GRPOFLOW_UPLOAD_DIR")
        with served(plugin.WeightUpload(inner)) as off:
            with pytest.raises(TransportError, match=f"{off} takes no uploads"):
                choose(off, "network")

            async def reads_nothing(req):  # FAKE: a server whose host cannot see the learner's disk
                return None

            monkeypatch.setattr(plugin, "_probe", reads_nothing)
            with pytest.raises(TransportError, match=f"'path' but the vLLM server at {off} cannot read"):
                choose(off, "path")
            with pytest.raises(
                TransportError, match="takes no uploads .* and cannot read the learner's files"
            ):
                choose(off, "auto")


def test_forget_keeps_on_the_server_what_the_learner_keeps(plugin, tmp_path, monkeypatch):
    t = Transport("r", "network")
    with served(plugin.WeightUpload(inner)) as url:
        for v in (1, 2, 3):
            on(url, lambda c, v=v: t.deliver(c, str(version(tmp_path, v, 1000)), v))
        other = Transport("other", "network")  # another run's version on the same server
        on(url, lambda c: other.deliver(c, str(tmp_path / "weights/r/v000001"), 1))
        t.forget([2, 3], lambda u: VLLMClient(u))
        left = on(url, lambda c: c.uploaded_versions())
    assert sorted(left) == ["other/v000001", "r/v000002", "r/v000003"]


def test_a_full_weights_upload_overwrites_the_version_retention_drops_next_never_the_served_one(
    plugin, tmp_path
):
    t = Transport("r", "network", recycle=2)
    with served(plugin.WeightUpload(inner)) as url:
        sent = [
            on(url, lambda c, v=v: t.deliver(c, str(version(tmp_path, v, 5000 + v)), v)) for v in (1, 2, 3)
        ]
        # v1 became v3's staging dir: two versions left, v3's bytes exact (a shorter file: truncated)
        assert on(url, lambda c: c.uploaded_versions()) == ["r/v000002", "r/v000003"]
        for f in ("config.json", "model.safetensors"):
            assert (tmp_path / "uploads/r/v000003" / f).read_bytes() == (
                tmp_path / "weights/r/v000003" / f
            ).read_bytes()
        one = Transport("r", "network", recycle=1)  # keep_last 1: the only other one is served, kept
        t.forget([3], lambda u: VLLMClient(u))
        on(url, lambda c: one.deliver(c, str(version(tmp_path, 4, 100)), 4, serving=sent[2].path))
        assert on(url, lambda c: c.uploaded_versions()) == ["r/v000003", "r/v000004"]


def test_a_version_delivered_with_reuse_is_sent_once(plugin, tmp_path):
    v1 = version(tmp_path, 1, 1000)
    t = Transport("ada", "network")
    with served(plugin.WeightUpload(inner)) as url:
        first = on(url, lambda c: t.deliver_as(c, str(v1), "ada@lineage/adapter-1", reuse=True))
        again = on(url, lambda c: t.deliver_as(c, str(v1), "ada@lineage/adapter-1", reuse=True))
    assert first.bytes == 1002 and again.bytes == 0 and first.path == again.path
    assert again.path == str(tmp_path / "uploads" / "ada@lineage" / "adapter-1")


def test_client_connections_notice_a_vanished_peer_within_seconds():
    """Every connection of the client carries TCP keepalive (and a user timeout): a server whose host
    vanished fails its requests in seconds instead of their timeout (the death of a whole host is
    tests/integration/test_hosts_push.py's)."""
    import socket

    from grpoflow.tasks.rollouts import inference

    async def connector_factory():
        async with VLLMClient("http://127.0.0.1:9") as c:
            return c._get_session().connector._socket_factory

    assert asyncio.run(connector_factory()) is inference.keepalive_socket
    sock = inference.keepalive_socket((socket.AF_INET, socket.SOCK_STREAM, 0, "", ("127.0.0.1", 9)))
    with sock:
        assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) == 1
        idle = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE)
        probes = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT)
        interval = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL)
        assert (
            idle + probes * interval <= 15
            and sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT) > 0
        )


def test_a_server_that_cannot_take_the_transport_fails_the_push_even_beside_others(tmp_path):
    """Among several servers, one that cannot take sync.transport stops the push with its error (a
    config error for the one `error:` line), rather than leaving the rotation to be revived forever."""
    from grpoflow.tasks.push.push import Sent, push_version
    from grpoflow.tasks.rollouts.replicas import Replica, ReplicaSet

    class OneRefuses:  # a WeightPush whose second server refuses the transport (FAKE servers)
        def save(self, write, version):
            return str(tmp_path)

        async def load(self, url, path, version, on_loaded=None):
            if url == "http://b":
                raise TransportError("sync.transport is 'path' but the vLLM server at http://b cannot read")
            return Sent(Sent.PATH, path)

        def forget(self):
            pass

        def model_name(self, version):
            return None

    replicas = ReplicaSet([Replica(0, "http://a"), Replica(1, "http://b")])
    with pytest.raises(TransportError, match="http://b"):
        push_version(OneRefuses(), lambda d: None, 1, replicas)
    assert all(r.healthy for r in replicas.replicas)  # nobody sent to revival
    replicas.close()

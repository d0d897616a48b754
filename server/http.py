"""What grpoflow's middlewares in the vLLM server share (lease, alias, upload, auth): a request's route,
and a JSON answer. Standard library only."""

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

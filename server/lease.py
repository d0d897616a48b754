"""ASGI middleware loaded INTO the vLLM server (`--middleware grpoflow.server.lease.PauseLease`): a pause has
an owner and a lease.

A trainer pauses the server to reload weights, then resumes it. A trainer that dies in between (SIGKILL,
OOM) leaves a long-lived server paused for good, and vLLM records nothing about who paused it. Here
`POST /pause?owner=...&lease_s=...` records the owner and when the lease ends, `POST /resume` clears
it, and `GET /grpoflow/pause_lease` tells a supervisor whether a pause is still someone's (within its
lease: a reload in progress) or abandoned. Standard library only.
"""

from __future__ import annotations

import time
from urllib.parse import parse_qs

from grpoflow.server.http import reply_json, route
from grpoflow.server.protocol import PAUSE, PAUSE_LEASE, PAUSE_LEASE_S, PAUSE_OWNER, RESUME, LeaseState

DEFAULT_LEASE_S = 900.0  # a pause without a lease (another client) counts as owned this long

_lease: dict = {}  # {"owner": str, "deadline": monotonic seconds, "paused_at": epoch seconds}


class PauseLease:
    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path, method = route(scope)
        if path == PAUSE_LEASE and method == "GET":
            return await reply_json(send, _state())
        if path == PAUSE and method == "POST":
            q = parse_qs(scope.get("query_string", b"").decode("latin-1"))
            try:
                lease_s = float(q.get(PAUSE_LEASE_S, [DEFAULT_LEASE_S])[0])
            except ValueError:
                lease_s = DEFAULT_LEASE_S
            _lease.clear()
            owner = q.get(PAUSE_OWNER, ["unknown"])[0]
            _lease.update(owner=owner, deadline=time.monotonic() + lease_s, paused_at=time.time())
        elif path == RESUME and method == "POST":
            _lease.clear()
        return await self.app(scope, receive, send)


def _state() -> LeaseState:
    if not _lease:
        return LeaseState(owner=None, expires_in_s=None, paused_at=None)
    left = _lease["deadline"] - time.monotonic()
    return LeaseState(owner=_lease["owner"], expires_in_s=round(left, 3), paused_at=_lease["paused_at"])

"""ASGI middleware loaded INTO the vLLM server (`--middleware grpoflow.server.auth.RequireApiKey`).

vLLM's own `--api-key` guards only /v1, /v2, /inference and /cohere; the dev-mode control endpoints
grpoflow needs (/pause, /resume, /collective_rpc, used to reload weights) stay open. When the server has
a key (env VLLM_API_KEY), this middleware requires `Authorization: Bearer <key>` on every path except
the health probes. Standard library only.
"""

from __future__ import annotations

import hashlib
import hmac
import os

from grpoflow.server.http import reply_json, route
from grpoflow.server.protocol import API_KEY_ENV, AUTHORIZATION, BEARER, HEALTH_PATHS, Error


class RequireApiKey:
    def __init__(self, app):
        self.app = app
        key = os.environ.get(API_KEY_ENV) or ""
        self.digest = hashlib.sha256(key.encode()).digest() if key else None

    def _authorized(self, scope) -> bool:
        for name, value in scope.get("headers") or []:
            if name.lower() == AUTHORIZATION.lower().encode():
                scheme, _, token = value.decode("latin-1").partition(" ")
                if scheme.lower() == BEARER.lower():
                    return hmac.compare_digest(hashlib.sha256(token.encode()).digest(), self.digest)
        return False

    async def __call__(self, scope, receive, send):
        if self.digest is None or scope["type"] not in ("http", "websocket"):
            return await self.app(scope, receive, send)
        path, method = route(scope)
        if path in HEALTH_PATHS or method == "OPTIONS" or self._authorized(scope):
            return await self.app(scope, receive, send)
        if scope["type"] == "websocket":
            return await send({"type": "websocket.close", "code": 1008})
        await reply_json(send, Error(error="Unauthorized"), 401)

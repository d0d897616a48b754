"""ASGI middleware loaded INTO the vLLM server (`--middleware grpoflow.server.alias.ModelAlias`): model-name
aliases, so a LoRA lineage's name can be re-pointed from one loaded adapter to another in one step.

vLLM 0.32 offers no atomic re-point: unload + load leaves a window where the name answers 404, and
`load_inplace` stays set on the registered adapter, so the engine re-reads its files from disk at every
step that runs it (lora/worker_manager.py: add_adapter). Here each adapter is loaded once under an
internal name of its own (no in-place flag) and the lineage's name is an alias of it:

- `POST /grpoflow/alias` {"name": ..., "target": ...} points `name` at the loaded adapter `target`
  (`target` null removes the alias); `GET /grpoflow/aliases` answers {"aliases": {name: target},
  "in_flight": {target: requests}}: requests rewritten to a target whose answer has not ended yet,
  so the caller unloads a replaced target only once the requests sent to it have resolved it.
- A JSON POST (vLLM refuses any other media type on the routes that take a model: the generation,
  pooling, tokenizer and render routes alike) whose top-level "model" is an alias gets its target's
  name instead, content-length fixed; every other body passes through byte for byte.
- `GET /v1/models` lists each alias as a copy of its target's card under the alias's id (its "root"
  the target adapter's path), so clients listing models see the lineage names.

The table lives in this API server process (one per server; lost with it: whoever loads the adapters
after a restart points the aliases again). Standard library only.
"""

from __future__ import annotations

import json

from grpoflow.server.http import reply_json, route
from grpoflow.server.protocol import ALIAS, ALIASES, AliasAnswer, AliasTable

_aliases: dict[str, str] = {}  # alias -> the loaded adapter's (or model's) name it stands for
_in_flight: dict[str, int] = {}  # target -> requests rewritten to it whose answer has not ended


class ModelAlias:
    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path, method = route(scope)
        if path == ALIASES and method == "GET":
            return await reply_json(send, AliasTable(aliases=dict(_aliases), in_flight=dict(_in_flight)))
        if path == ALIAS and method == "POST":
            return await _set_alias(await _read_body(receive), send)
        if not _aliases:  # nothing to rewrite: no buffering at all
            return await self.app(scope, receive, send)
        if path == "/v1/models" and method == "GET":
            return await self.app(scope, receive, _ModelsWithAliases(send))
        if method != "POST" or _media_type(scope) != "application/json":
            return await self.app(scope, receive, send)
        body = await _read_body(receive)
        target = _aliased_model(body)
        if target is None:
            return await self.app(scope, _replay(body, receive), send)
        obj = json.loads(body)
        obj["model"] = target
        body = json.dumps(obj).encode()
        headers = [(k, v) for k, v in scope.get("headers") or [] if k.lower() != b"content-length"]
        scope = {**scope, "headers": [*headers, (b"content-length", str(len(body)).encode())]}
        _in_flight[target] = _in_flight.get(target, 0) + 1
        try:
            return await self.app(scope, _replay(body, receive), send)
        finally:
            if _in_flight[target] <= 1:
                del _in_flight[target]
            else:
                _in_flight[target] -= 1


def _aliased_model(body: bytes) -> str | None:
    """The target of the body's top-level "model" when that is an alias; None for anything else
    (not JSON, not an object, no such alias): the body then goes on untouched."""
    try:
        obj = json.loads(body)
    except ValueError:  # UnicodeDecodeError included
        return None
    model = obj.get("model") if isinstance(obj, dict) else None
    return _aliases.get(model) if isinstance(model, str) else None


async def _set_alias(body: bytes, send) -> None:
    try:
        req = json.loads(body)
        name, target = req["name"], req["target"]
    except (ValueError, TypeError, KeyError):
        return await reply_json(
            send, {"error": 'body must be a JSON object {"name": ..., "target": ...}'}, 400
        )
    if not isinstance(name, str) or not name or not (target is None or (isinstance(target, str) and target)):
        return await reply_json(send, {"error": "name must be a non-empty string, target one or null"}, 400)
    if target is not None and (target == name or target in _aliases or name in _aliases.values()):
        # One hop only: a request's model is rewritten once, so a chain would reach vLLM as an alias.
        return await reply_json(send, {"error": f"alias {name!r} -> {target!r} would make a chain"}, 400)
    previous = _aliases.pop(name, None) if target is None else _aliases.get(name)
    if target is not None:
        _aliases[name] = target
    await reply_json(send, AliasAnswer(name=name, target=target, previous=previous))


class _ModelsWithAliases:
    """`send` for GET /v1/models: holds the answer back until its last chunk, then adds a card per
    alias whose target is listed. An answer it cannot read (not JSON, an error) goes out as it came."""

    def __init__(self, send):
        self.send, self.start, self.chunks = send, None, []

    async def __call__(self, message):
        if message["type"] == "http.response.start":
            self.start = message
            return None
        if message["type"] != "http.response.body" or self.start is None:
            return await self.send(message)
        self.chunks.append(message.get("body", b""))
        if message.get("more_body"):
            return None
        body = b"".join(self.chunks)
        if self.start.get("status") == 200:
            body = _with_alias_cards(body)
        headers = [(k, v) for k, v in self.start.get("headers") or [] if k.lower() != b"content-length"]
        await self.send({**self.start, "headers": [*headers, (b"content-length", str(len(body)).encode())]})
        await self.send({"type": "http.response.body", "body": body})


def _with_alias_cards(body: bytes) -> bytes:
    try:
        obj = json.loads(body)
        cards = obj["data"]
        by_id = {c["id"]: c for c in cards}
    except (ValueError, TypeError, KeyError):
        return body
    added = [{**by_id[t], "id": a} for a, t in _aliases.items() if t in by_id and a not in by_id]
    if not added:
        return body
    obj["data"] = [*cards, *added]
    return json.dumps(obj).encode()


def _media_type(scope) -> str:
    for name, value in scope.get("headers") or []:
        if name.lower() == b"content-type":
            return value.decode("latin-1").split(";", 1)[0].strip().lower()
    return ""


async def _read_body(receive) -> bytes:
    chunks = []
    while True:
        message = await receive()
        if message["type"] != "http.request":  # the client went away: what came so far
            break
        chunks.append(message.get("body", b""))
        if not message.get("more_body"):
            break
    return b"".join(chunks)


def _replay(body: bytes, receive):
    """A `receive` that gives the (re-emitted) body once, then whatever the client sends next
    (http.disconnect, which vLLM watches to abort a request whose client left)."""
    sent = False

    async def replay():
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay

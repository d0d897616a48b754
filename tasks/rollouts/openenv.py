"""OpenEnv environment servers as environments: `tools.environment: "http://host:8000"` (or one entry of
the dict form) trains against a running OpenEnv server with no wrapper class.

Each rollout is one session: a WebSocket to the server's `/ws` (OpenEnv's persistent-session endpoint,
where the server gives every connection its own environment instance). `reset` sends the row's fields
(OpenEnv passes those its `reset()` accepts), and the observation becomes the prompt's note. The
environment's tools are its MCP tool list (`list_tools`; each model call is a `call_tool` step); an
environment without MCP tools has one tool, `step`, whose arguments are its action schema (`/schema`).
Each step's observation is the tool message; its `reward` is kept and its `done` ends the rollout. The
session's reward, as TRL's `get_reward()`, is the sum of the step rewards (None when the environment
gave none): a cell like any environment's (tasks/rewards/env_reward.py).

A session that cannot be opened, or whose connection breaks, is `EnvironmentUnavailableError`: the
rollout keeps what it has, and its reward cell fails (never 0); a tool call that hangs is cut off at
`tools.tool_timeout_s` and its session closed (the pool replaces it). Only aiohttp: the `openenv`
package is the server's, not the trainer's.
"""

from __future__ import annotations

import contextlib
import json
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import aiohttp

from grpoflow.tasks.config.rollouts import is_server_url
from grpoflow.tasks.rollouts.tools import resolve_callable, served_tool

OPEN_TIMEOUT_S = 30.0  # opening a session: connect, and the server making its environment


class EnvironmentUnavailableError(ConnectionError):
    """The environment server cannot be reached, or its session broke."""


def resolve_environment(spec: Any) -> Any:
    """An environment factory from `tools.environment`'s value: a server URL, an import path, a class."""
    return OpenEnvServer(spec) if is_server_url(spec) else resolve_callable(spec)


def _base(url: str) -> str:
    """The server's HTTP base URL (a ws:// form is accepted too)."""
    parts = urlsplit(url.rstrip("/"))
    scheme = {"ws": "http", "wss": "https"}.get(parts.scheme, parts.scheme)
    return urlunsplit((scheme, parts.netloc, parts.path, "", ""))


class OpenEnvServer:
    """A factory of sessions with the server at `url` (what `tools.environment` names); its sessions'
    get_reward() reward is named `reward_name`."""

    reward_name = "openenv"

    def __init__(self, url: str):
        self.url = _base(url)

    def __call__(self) -> OpenEnvSession:
        return OpenEnvSession(self.url)

    @property
    def get_reward(self):  # its sessions have one (tasks/rewards/env_reward.py: has_reward)
        return OpenEnvSession.get_reward

    def __repr__(self) -> str:
        return f"OpenEnvServer({self.url})"


def _text(obs: dict[str, Any]) -> str:
    """An observation as the model reads it: its one text field, else its fields as JSON (its metadata
    when it has nothing else; nothing at all when that is empty too)."""
    fields = {k: v for k, v in obs.items() if k != "metadata"} or obs.get("metadata") or {}
    texts = [v for v in fields.values() if isinstance(v, str)]
    if len(texts) == 1:
        return texts[0]
    return json.dumps(fields, sort_keys=True, default=str) if fields else ""


def _tool_result(obs: dict[str, Any]) -> str:
    """A `call_tool` observation's result (MCP content: its text parts), or its error."""
    if obs.get("error"):
        raise RuntimeError(f"tool error: {obs['error']}")
    result = obs.get("result")
    if isinstance(result, dict) and isinstance(result.get("content"), list):
        texts = [c.get("text", "") for c in result["content"] if isinstance(c, dict)]
        if result.get("isError") or result.get("is_error"):
            raise RuntimeError("; ".join(texts) or "the tool reported an error")
        return "\n".join(texts)
    return result if isinstance(result, str) else json.dumps(result, default=str)


class OpenEnvSession:
    """One rollout's session (the module doc). Pooled like any environment instance: `reset` closes the
    session it held and opens a new one; `aclose` closes it for good."""

    def __init__(self, url: str):
        self.url = url
        self._http: aiohttp.ClientSession | None = None
        self._ws: aiohttp.ClientWebSocketResponse | None = None
        self.rewards: list[float] = []
        self.observations: list[dict[str, Any]] = []
        self.done, self.broken = False, None  # broken: why the session stopped answering
        self.sessions = 0  # sessions this instance opened
        self._tools: dict[str, Any] = {}

    # -- the environment contract (tasks/rollouts/multi_turn.py) -----------------------------------

    async def reset(self, **row: Any) -> str:
        await self.aclose()
        self.rewards, self.observations, self.done, self.broken = [], [], False, None
        data = {k: v for k, v in row.items() if k != "prompt"}
        try:
            self._http = aiohttp.ClientSession(
                timeout=aiohttp.ClientTimeout(total=None, connect=OPEN_TIMEOUT_S)
            )
            ws_url = "ws" + self.url[len("http") :] + "/ws"
            self._ws = await self._http.ws_connect(ws_url, heartbeat=None, max_msg_size=0)
            self.sessions += 1
            obs = await self._send({"type": "reset", "data": json.loads(json.dumps(data, default=str))})
            self._tools = await self._discover()
        except (aiohttp.ClientError, RuntimeError) as e:  # RuntimeError: the server refused the reset
            await self.aclose()
            why = f"cannot open a session at {self.url}: {type(e).__name__}: {e}"
            raise self._lost(why if isinstance(e, aiohttp.ClientError) else f"{self.url}: {e}") from e
        return _text(obs)

    def grpoflow_tools(self) -> dict[str, Any]:
        """The model's tools this session offers: callables with their schemas (`__tool_schema__`)."""
        return dict(self._tools)

    def get_reward(self) -> float | None:
        if self.broken:
            raise EnvironmentUnavailableError(self.broken)
        return sum(self.rewards) if self.rewards else None

    def snapshot(self) -> dict[str, Any]:
        """What the reward functions get: the session's observations, rewards and end."""
        return {
            "url": self.url,
            "observations": list(self.observations),
            "rewards": list(self.rewards),
            "done": self.done,
            "broken": self.broken,
        }

    async def aclose(self) -> None:
        ws, http, self._ws, self._http = self._ws, self._http, None, None
        if ws is not None and not ws.closed:
            # a broken session: closing it is all that is left
            with contextlib.suppress(aiohttp.ClientError, ConnectionError, RuntimeError):
                await ws.send_str(json.dumps({"type": "close"}))
            await ws.close()
        if http is not None:
            await http.close()

    # -- the wire -----------------------------------------------------------------------------------

    def _lost(self, why: str) -> EnvironmentUnavailableError:
        self.broken = self.broken or why
        return EnvironmentUnavailableError(why)

    async def _send(self, message: dict[str, Any]) -> dict[str, Any]:
        """One request and its answer on the session; the observation's fields (reward and done kept)."""
        if self._ws is None or self._ws.closed:
            raise self._lost(self.broken or f"the session with {self.url} is closed")
        try:
            await self._ws.send_str(json.dumps(message))
            msg = await self._ws.receive()
        except (aiohttp.ClientError, ConnectionError) as e:
            raise self._lost(f"the session with {self.url} broke: {type(e).__name__}: {e}") from e
        if msg.type != aiohttp.WSMsgType.TEXT:
            raise self._lost(f"the session with {self.url} ended ({msg.type.name})")
        answer = json.loads(msg.data)
        if answer.get("type") == "error":
            raise RuntimeError(f"the environment refused {message['type']}: {answer['data'].get('message')}")
        data = answer.get("data", {})
        obs = dict(data.get("observation", {}))
        if data.get("metadata") and not obs.get("metadata"):  # OpenEnv sends it beside the observation too
            obs["metadata"] = data["metadata"]
        self.observations.append(obs)
        if data.get("reward") is not None:
            self.rewards.append(float(data["reward"]))
        self.done = self.done or bool(data.get("done"))
        return obs

    async def _discover(self) -> dict[str, Any]:
        """The MCP tool list; else one `step` tool over the action schema."""
        try:
            listed = await self._send({"type": "step", "data": {"type": "list_tools"}})
            tools = listed.get("tools") or []
        except RuntimeError:  # an environment without MCP: its action validation refused the request
            tools = []
        self.observations.clear()  # discovery is not part of the episode
        if tools:
            return {t["name"]: self._mcp_tool(t) for t in tools}
        async with self._http.get(f"{self.url}/schema") as r:
            r.raise_for_status()
            action = (await r.json()).get("action", {})
        return {"step": self._action_tool(action)}

    def _mcp_tool(self, spec: dict[str, Any]):
        async def call(**arguments: Any) -> str:
            obs = await self._send(
                {
                    "type": "step",
                    "data": {"type": "call_tool", "tool_name": spec["name"], "arguments": arguments},
                }
            )
            return _tool_result(obs)

        return served_tool(
            call, spec["name"], spec.get("description"), spec.get("inputSchema") or spec.get("input_schema")
        )

    def _action_tool(self, action: dict[str, Any]):
        async def step(**arguments: Any) -> str:
            return _text(await self._send({"type": "step", "data": arguments}))

        params = {k: v for k, v in action.items() if k in ("type", "properties", "required")}
        params["properties"] = {k: v for k, v in params.get("properties", {}).items() if k != "metadata"}
        description = action.get("description") or "Act in the environment."
        return served_tool(step, "step", description, {"type": "object", **params})

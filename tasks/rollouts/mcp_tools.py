"""Tools from MCP servers (`tools.mcp`): each server's tools join the rollout's tools with the schemas
the server gives, and a call is `tools/call` on a connection to it, recorded as a `ToolCallRecord` like
any tool's (arguments, result or error, duration, node: this process's).

A server is reached over streamable HTTP (`url`) or stdio (`command`: the server is a child process).
By default one connection serves a whole batch of rollouts (`generate_groups`: a batch runs on its own
event loop, which a connection cannot outlive), its calls shared; `per_rollout` opens one per rollout,
for a server that keeps state per MCP session. A call's text is the result's text content; a result
marked `isError` is a failed call. The `mcp` package (`grpoflow[mcp]`) is imported only here.
"""

from __future__ import annotations

import contextlib
import json
import shlex
from collections.abc import AsyncIterator, Callable
from typing import Any

from grpoflow.tasks.config.rollouts import McpServerConfig
from grpoflow.tasks.rollouts.tools import served_tool

MCP_EXTRA = "pip install 'grpoflow[mcp]'"


class McpMissingError(ImportError):
    """tools.mcp names servers but the `mcp` package is not installed."""


def _mcp():
    try:
        import mcp
        from mcp.client.stdio import StdioServerParameters, stdio_client
        from mcp.client.streamable_http import streamable_http_client
    except ImportError:
        raise McpMissingError(f"tools.mcp needs the 'mcp' package: {MCP_EXTRA}") from None
    return mcp.ClientSession, StdioServerParameters, stdio_client, streamable_http_client


def describe(server: McpServerConfig) -> str:
    return server.url or shlex.join(server.command or [])


@contextlib.asynccontextmanager
async def connect(server: McpServerConfig) -> AsyncIterator[Any]:
    """An initialized MCP client session with `server`, closed (a stdio server's process ended) on exit."""
    ClientSession, StdioServerParameters, stdio_client, streamable_http_client = _mcp()
    if server.url is not None:
        transport = streamable_http_client(server.url)
    else:
        cmd = server.command or []
        transport = stdio_client(StdioServerParameters(command=cmd[0], args=cmd[1:]))
    async with transport as (read, write), ClientSession(read, write) as session:
        await session.initialize()
        yield session


def _text(result: Any) -> str:
    texts = [getattr(c, "text", None) for c in result.content]
    if all(t is not None for t in texts):
        return "\n".join(texts)
    structured = getattr(result, "structured_content", None)
    return json.dumps(
        structured if structured is not None else [c.model_dump() for c in result.content], default=str
    )


def session_tools(server: McpServerConfig, session: Any, listed: list[Any]) -> dict[str, Callable[..., Any]]:
    """`listed` (the server's `tools/list`) as the model's tools, each a call on `session`."""

    def tool(spec: Any) -> Callable[..., Any]:
        async def call(**arguments: Any) -> str:
            result = await session.call_tool(spec.name, arguments)
            if getattr(result, "is_error", False):
                raise RuntimeError(_text(result) or f"{spec.name} reported an error")
            return _text(result)

        return served_tool(call, spec.name, spec.description, spec.input_schema)

    return {t.name: tool(t) for t in listed}


async def list_tools(session: Any) -> list[Any]:
    out, cursor = [], None
    while True:
        page = await session.list_tools(params=None if cursor is None else {"cursor": cursor})
        out += page.tools
        cursor = getattr(page, "next_cursor", None)
        if not cursor:
            return out


@contextlib.asynccontextmanager
async def mcp_tools(servers: list[McpServerConfig]) -> AsyncIterator[dict[str, Callable[..., Any]]]:
    """The tools of `servers` over one connection each, for the duration of the block."""
    async with contextlib.AsyncExitStack() as stack:
        tools: dict[str, Callable[..., Any]] = {}
        for server in servers:
            session = await stack.enter_async_context(connect(server))
            tools |= session_tools(server, session, await list_tools(session))
        yield tools


async def tool_names(server: McpServerConfig) -> list[str]:
    """The names `server` lists (preflight: a clash with another tool's name is refused)."""
    async with connect(server) as session:
        return [t.name for t in await list_tools(session)]

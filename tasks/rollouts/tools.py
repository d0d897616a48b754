"""Tools for multi-turn rollouts: schemas, tool-call parsing, execution with timeouts.

Tools are plain functions (sync or `async def`) with Google-style docstrings; schemas come from
`transformers.utils.get_json_schema`. Every failure (malformed JSON, unknown tool, wrong arguments,
an exception, a timeout) becomes a tool message with the error and `ToolCallRecord(failed=True)`;
the rollout goes on. Arguments are parsed with `json.loads`, never evaluated.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from grpoflow.storage.records import ToolCallRecord
from grpoflow.tasks.config.imports import import_object
from grpoflow.tasks.remote import call_on_ray, this_node
from grpoflow.tasks.threads import in_daemon_thread


@dataclass
class ParsedCall:
    name: str
    arguments: dict[str, Any] | None  # None when the call could not be parsed
    raw: str  # the text between the tags, as the model wrote it
    error: str | None = None


class ToolCallParser(Protocol):
    """Reads tool calls from the model's text, and describes the format it reads: a chat template
    that does not render tool schemas gets that description in the system turn instead."""

    def parse(self, text: str) -> list[ParsedCall]: ...

    def instructions(self, schemas: list[dict[str, Any]]) -> str: ...


class HermesToolParser:
    """`<tool_call>{"name": ..., "arguments": {...}}</tool_call>` (Hermes / Qwen2.5 format)."""

    def instructions(self, schemas: list[dict[str, Any]]) -> str:
        tools = "\n".join(json.dumps(s.get("function", s)) for s in schemas)
        return (
            "You can call these tools:\n<tools>\n"
            f"{tools}\n</tools>\n"
            "To call a tool, write one line "
            '<tool_call>{"name": "<tool name>", "arguments": {"<argument>": <value>}}</tool_call> '
            "and stop. The result comes back in the next message; then answer."
        )

    pattern = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)

    def parse(self, text: str) -> list[ParsedCall]:
        calls = []
        for m in self.pattern.finditer(text):
            raw = m.group(1).strip()
            try:
                obj = json.loads(raw)
            except json.JSONDecodeError as e:
                calls.append(ParsedCall("", None, raw, f"malformed tool call JSON: {e}"))
                continue
            if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
                calls.append(ParsedCall("", None, raw, "tool call must be an object with a string 'name'"))
                continue
            args = obj.get("arguments", {})
            if isinstance(args, str):  # some models JSON-encode the arguments twice
                try:
                    args = json.loads(args)
                except json.JSONDecodeError as e:
                    calls.append(ParsedCall(obj["name"], None, raw, f"malformed arguments JSON: {e}"))
                    continue
            if not isinstance(args, dict):
                calls.append(ParsedCall(obj["name"], None, raw, "'arguments' must be an object"))
                continue
            calls.append(ParsedCall(obj["name"], args, raw))
        return calls


def served_tool(
    fn: Callable[..., Any], name: str, description: str | None, parameters: dict[str, Any] | None
) -> Callable[..., Any]:
    """`fn` as the tool `name`, with the schema a server gives (an MCP or OpenEnv tool) instead of one
    read from its signature (`tool_schema`)."""
    fn.__name__ = name
    fn.__tool_schema__ = {
        "type": "function",
        "function": {
            "name": name,
            "description": description or "",
            "parameters": parameters or {"type": "object", "properties": {}},
        },
    }
    return fn


def tool_schema(fn: Callable[..., Any]) -> dict[str, Any]:
    """A tool's JSON schema: the one it carries (`__tool_schema__`: an environment server's tool, as the
    server gives it), else from its signature and docstring."""
    own = getattr(fn, "__tool_schema__", None)
    if own is not None:
        return own
    from transformers.utils import get_json_schema

    return get_json_schema(fn)


def environment_tools(env: Any) -> dict[str, Callable[..., Any]]:
    """Public methods of an environment instance, except its lifecycle/reward methods; an environment
    server's session gives its own (`grpoflow_tools()`, tasks/rollouts/openenv.py)."""
    own = getattr(env, "grpoflow_tools", None)
    if callable(own):
        return own()
    skip = {"reset", "get_reward", "snapshot", "aclose"}
    out = {}
    for name in dir(env):
        if name.startswith("_") or name in skip:
            continue
        attr = getattr(env, name)
        if callable(attr) and inspect.ismethod(attr):
            out[name] = attr
    return out


def resolve_callable(obj: str | Callable[..., Any]) -> Callable[..., Any]:
    """A tool or environment factory: an import path 'module:attr', or the callable itself."""
    return import_object(obj) if isinstance(obj, str) else obj


class ToolBox:
    """Executes parsed calls against named tools, each under a timeout. Tools named in `remote` run as
    Ray tasks reserving `num_cpus` (`tools.executor: ray`); `remote` maps a name to what the worker
    calls: the import path, or the function itself."""

    def __init__(
        self,
        tools: dict[str, Callable[..., Any]],
        timeout_s: float = 10.0,
        remote: dict[str, str | Callable[..., Any]] | None = None,
        num_cpus: float = 1.0,
    ):
        self.tools, self.timeout_s = tools, timeout_s
        self.remote, self.num_cpus = remote or {}, num_cpus
        # A timed-out sync call keeps running on its thread: whatever state it touches (an
        # environment) must not be handed to anyone else.
        self.timed_out = False

    async def call(self, call: ParsedCall, turn: int) -> ToolCallRecord:
        t0, node = time.perf_counter(), ""

        def record(result: str, error: str | None = None) -> ToolCallRecord:
            return ToolCallRecord(
                turn=turn,
                name=call.name,
                arguments=call.raw if call.arguments is None else json.dumps(call.arguments),
                result=result,
                failed=error is not None,
                error=error,
                duration_s=time.perf_counter() - t0,
                node=node,
            )

        if call.error is not None:
            return record(f"Error: {call.error}", call.error)
        fn = self.tools.get(call.name)
        if fn is None:
            err = f"unknown tool {call.name!r}; available: {sorted(self.tools)}"
            return record(f"Error: {err}", err)
        try:
            inspect.signature(fn).bind(**call.arguments)
        except TypeError as e:
            err = f"wrong arguments for {call.name}: {e}"
            return record(f"Error: {err}", err)
        deadline = asyncio.timeout(self.timeout_s)
        remote = self.remote.get(call.name)
        node = "" if remote is not None else this_node()  # a Ray call's node: where its task ran
        try:
            async with deadline:
                if remote is not None:
                    # cut off at the timeout with its worker killed: nothing of it runs on
                    out, node = await call_on_ray(remote, call.arguments, self.num_cpus)
                elif inspect.iscoroutinefunction(fn):
                    out = await fn(**call.arguments)
                else:
                    # A thread, so a slow sync tool never blocks other rollouts on the event loop; a
                    # daemon thread, so a hung one is abandoned after its timeout.
                    out = await in_daemon_thread(fn, **call.arguments)
        except Exception as e:
            # Only our own deadline is a timeout; a TimeoutError the tool raised itself is a failure
            # with its own message (the same rule as reward functions, tasks/rewards/score.py).
            if isinstance(e, TimeoutError) and deadline.expired():
                self.timed_out = self.timed_out or remote is None  # a killed Ray task left nothing behind
                err = f"tool {call.name} timed out after {self.timeout_s}s"
            else:
                err = f"{type(e).__name__}: {e}"
                node = getattr(e, "ray_node", None) or node  # raised in a Ray task: where it ran
            return record(f"Error: {err}", err)
        return record(out if isinstance(out, str) else json.dumps(out, default=str))

"""The `vf.Client` grpoflow gives verifiers (tasks/rollouts/verifiers_env.py): one per rollout, answering
each model turn of its episode on the rollout's server, and keeping the episode as one token sequence.

The first turn renders the harness's conversation with the run's chat template (the tools in the system
turn where the template ignores `tools=`, as grpoflow's own rollouts put them); each later turn adds the
model's last reply as it was sampled (mask 1) and the template glue of what the harness added after it
(tool results, a user turn: `glue_ids`, mask 0). Tool calls are parsed with the run's format and handed
to the harness as structured calls; the tool results that come back are `ToolCallRecord`s.
"""

from __future__ import annotations

import json
import re
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from grpoflow.storage.records import TaggedMessage, ToolCallRecord, TurnRecord
from grpoflow.tasks.remote import this_node
from grpoflow.tasks.rollouts.inference_api import InferenceUnavailableError
from grpoflow.tasks.rollouts.rollout_settings import RolloutSettings, request_turn, sample_seed, strip_eos
from grpoflow.tasks.rollouts.templates import glue_ids, render, with_system_text


def wire_messages(messages: Any) -> list[dict[str, Any]]:
    from verifiers.v1.dialects.chat import message_to_wire

    return [{k: v for k, v in message_to_wire(m).items() if v is not None} for m in messages]


class HistoryRewritten(ValueError):
    """The harness sent a conversation that does not extend the episode's last one."""


@dataclass
class Session:
    """One seat's conversation with the policy: the token sequence, as a multi-turn rollout keeps it."""

    history: list[dict[str, Any]] = field(default_factory=list)
    seen: int = 0  # messages of the harness's conversation already in `history`
    schemas: list[dict[str, Any]] | None = None
    ids: list[int] = field(default_factory=list)
    prompt_len: int = 0
    prompt_text: str = ""
    mask: list[int] = field(default_factory=list)
    lps: list[float] = field(default_factory=list)
    msgs: list[TaggedMessage] = field(default_factory=list)
    turns: list[TurnRecord] = field(default_factory=list)
    calls: list[ToolCallRecord] = field(default_factory=list)
    asked: dict[str, tuple[str, str]] = field(default_factory=dict)  # call id -> (name, arguments)
    last_text: str = ""
    ended_eos: bool = False
    finish: str = "stop"
    truncation: str | None = None
    version: int | None = None


class PolicyClient:
    """One rollout's `vf.Client` (the class is made a subclass of it on first use, so that this module
    imports without verifiers): each model turn of its episode, on the rollout's server."""

    def __init__(self, r: RolloutSettings, index: int, sample: int):
        self.r, self.index, self.sample = r, index, sample
        self.sessions: dict[str, Session] = {}
        self.unavailable: InferenceUnavailableError | None = None

    async def get_response(self, dialect, body, sampling, session_id=None, turn=None, headers=None):
        from verifiers.v1.clients.train import tool_to_wire

        s = self.sessions.setdefault(session_id or "", Session())
        if turn is not None:
            messages, tools = turn.prompt, turn.tools
        else:
            request = dialect.parse_request(body)
            messages, tools = request.messages, request.tools
        self._extend(s, wire_messages(messages), [tool_to_wire(t) for t in tools or []] or None)
        r = self.r
        limit = min(r.gen.max_tokens, r.budget - sum(s.mask), r.max_len - len(s.ids))
        if getattr(sampling, "max_tokens", None):
            limit = min(limit, sampling.max_tokens)
        if len(s.turns) >= r.gen.max_turns or limit <= 0:
            s.truncation = s.truncation or (
                "max_turns" if len(s.turns) >= r.gen.max_turns else "token_budget"
            )
            return _response(body["model"], "", [], "length", s.ids, None)
        before = list(s.ids)
        seed = sample_seed(r.seed, self.index, self.sample, len(s.turns))
        try:
            ch, version = await request_turn(r, s.ids, limit, seed, s.turns)
        except InferenceUnavailableError as e:  # no server left: the group goes to another (generate.py)
            self.unavailable = e
            raise
        s.version = version if s.version is None else s.version
        ids, lps = list(ch.token_ids), list(ch.logprobs)
        s.ids += ids
        s.mask += [1] * len(ids)
        s.lps += lps
        raw = r.decode(ids)
        s.ended_eos = bool(r.eos_text) and raw.endswith(r.eos_text)
        s.last_text = text = strip_eos(raw, r.eos_text)
        s.msgs.append(TaggedMessage("assistant", text, True))
        s.finish = ch.finish_reason
        calls = self._calls(s, text) if s.schemas and ch.finish_reason != "length" else []
        if calls and len(s.turns) >= r.gen.max_turns:
            s.truncation, calls = "max_turns", []  # the harness ends the episode: no call to answer
        if ch.finish_reason == "length":
            s.truncation = "max_tokens"
        finish = "tool_calls" if calls else ("length" if ch.finish_reason == "length" else "stop")
        content = _without_calls(text) if calls else text
        return _response(body["model"], content, calls, finish, before, (ids, lps))

    def _extend(self, s: Session, wire: list[dict[str, Any]], schemas: list[dict[str, Any]] | None) -> None:
        """`s` brought up to the harness's conversation `wire`: rendered whole on the first turn, after
        that the model's last reply (as sampled) and the template glue of what followed it."""
        r = self.r
        if not s.turns:
            history = wire
            if schemas and r.tools_in_system_turn(schemas):
                history = with_system_text(history, r.parser.instructions(schemas))
            s.history, s.schemas = history, schemas
            s.prompt_text = render(r.tok, history, schemas, True)
            s.ids = r.tok.encode(s.prompt_text, add_special_tokens=False)
            s.prompt_len, s.seen = len(s.ids), len(wire)
            return
        if len(wire) <= s.seen or wire[s.seen].get("role") != "assistant":
            raise HistoryRewritten(
                f"the harness sent {len(wire)} messages that do not extend the episode's {s.seen + 1} "
                "(grpoflow trains one token sequence per rollout; a harness that compacts or rewrites "
                "the conversation cannot be trained on)"
            )
        tail = wire[s.seen + 1 :]
        glue = glue_ids(r.tok, r.eos_text, s.history, s.ended_eos, tail, s.schemas)
        s.history += [{"role": "assistant", "content": s.last_text}, *tail]
        s.ids += glue
        s.mask += [0] * len(glue)
        s.lps += [0.0] * len(glue)
        s.seen = len(wire)
        node = this_node()
        for m in tail:
            content = m.get("content")
            content = content if isinstance(content, str) else json.dumps(content)
            s.msgs.append(TaggedMessage(m.get("role", "user"), content, False))
            if m.get("role") == "tool" and m.get("tool_call_id") in s.asked:
                name, args = s.asked.pop(m["tool_call_id"])
                s.calls.append(ToolCallRecord(len(s.turns) - 1, name, args, content, node=node))

    def _calls(self, s: Session, text: str) -> list[Any]:
        from verifiers.v1.types import ToolCall

        out = []
        for i, p in enumerate(self.r.parser.parse(text)):
            if p.arguments is None:  # the harness never sees it: a failed call, as grpoflow's loop records it
                s.calls.append(ToolCallRecord(len(s.turns) - 1, p.name, p.raw, failed=True, error=p.error))
                continue
            call_id, args = f"call_{len(s.turns) - 1}_{i}", json.dumps(p.arguments)
            s.asked[call_id] = (p.name, args)
            out.append(ToolCall(id=call_id, name=p.name, arguments=args))
        return out


_CALL_MARKUP = re.compile(r"<tool_call>.*?(?:</tool_call>|$)", re.DOTALL)


def _without_calls(text: str) -> str | None:
    return _CALL_MARKUP.sub("", text).strip() or None


def _response(model: str, content, calls, finish: str, prompt_ids: list[int], sampled) -> Any:
    """The harness's answer: the message, and the turn's tokens (`sampled`: ids and logprobs; None when
    nothing was generated)."""
    from verifiers.v1.clients.train import serialize_completion
    from verifiers.v1.types import AssistantMessage, Response, TurnTokens, Usage

    ids, lps = sampled if sampled else ([], [])
    out = Response(
        id=f"grpoflow-{uuid.uuid4().hex[:12]}",
        created=int(time.time()),
        model=model,
        message=AssistantMessage(content=content or None, tool_calls=calls or None),
        finish_reason=finish,
        usage=Usage(prompt_tokens=len(prompt_ids), completion_tokens=len(ids)),
        tokens=TurnTokens.model_construct(
            prompt_ids=list(prompt_ids), completion_ids=list(ids), completion_logprobs=list(lps)
        ),
    )
    out.raw = serialize_completion(out, model)
    return out

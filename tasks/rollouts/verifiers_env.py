"""verifiers environments (`tools.verifiers`; verifiers 0.4, its `verifiers.v1` stack) run as verifiers runs
them, with every model turn on grpoflow's servers.

verifiers runs an episode as a program (its harness, e.g. the `null` chat loop) in a runtime (a
subprocess here), whose model requests go to verifiers' interception server; that server asks a
`vf.Client` for each response. A trainer's client (verifiers' own `TrainClient`, prime-rl's) renders the
prompt to token ids and asks its engine for tokens and logprobs. `PolicyClient` is grpoflow's: it renders
with the run's chat template and tool-call format, generates through the rollout's server
(`complete_served`: the served version's model name and cache salt, retries, the pause during a push),
and keeps one token sequence per episode as grpoflow's own multi-turn rollouts do: the model's tokens as
sampled (mask 1), then the tool results, user turns and template glue (`glue_ids`, mask 0). After the
episode, verifiers has scored it (its task's `@vf.reward`s and judges): the rewards, metrics and errors
become the rollout's `VerifiersOutcome`, scored as cells (tasks/rewards/vf_reward.py).

What grpoflow uses of verifiers, and what breaks when it moves (docs/environments.md):
`load_environment` / `resolve_env_config`, `Env.serving` and `Env.run_slot`, `Task.hooks('reward')`,
`vf.Client`, `ModelContext`, `TrainClientConfig`, the `Response`/`TurnTokens` types and
`serialize_completion`, and two internals: the interception server's `clients` map (keyed by the client
config's JSON), where each rollout's client is placed, since verifiers builds clients from configs only;
and the subprocess runtime's class-level setup locks, made per event loop (`_LocksPerLoop`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import shutil
import sys
import threading
import time
import uuid
import weakref
from dataclasses import dataclass, field
from typing import Any

from grpoflow.storage.records import RolloutCompletion, TaggedMessage, ToolCallRecord, TurnRecord
from grpoflow.tasks.config.imports import extend_sys_path
from grpoflow.tasks.remote import this_node
from grpoflow.tasks.rewards.vf_reward import VerifiersOutcome, outcome_of
from grpoflow.tasks.rollouts.inference_api import InferenceUnavailableError
from grpoflow.tasks.rollouts.rollout_settings import RolloutSettings, complete_served, sample_seed, strip_eos
from grpoflow.tasks.rollouts.templates import glue_ids, render, with_system_text

SUPPORTED = ("0.4.",)  # the verifiers releases this adapter was written against and tested with
EXTRA = "pip install 'grpoflow[verifiers]'"
EPISODE_TIMEOUT_S = 600.0  # verifiers' `timeout.episode` where the block sets none (verifiers: no limit)


class VerifiersMissingError(ImportError):
    """verifiers is not installed, or is a release this adapter does not know."""


def require() -> Any:
    """`verifiers.v1`, or a clear error naming the extra."""
    try:
        import verifiers
        import verifiers.v1 as vf
    except ImportError as e:
        raise VerifiersMissingError(f"tools.verifiers needs verifiers 0.4 ({EXTRA}): {e}") from None
    if not verifiers.__version__.startswith(SUPPORTED):
        raise VerifiersMissingError(
            f"tools.verifiers: verifiers {verifiers.__version__} is installed; grpoflow runs verifiers "
            f"{', '.join(v + 'x' for v in SUPPORTED)} ({EXTRA})"
        )
    return vf


def env_config(block: dict[str, Any]) -> Any:
    """The verifiers `[env]` config of `tools.verifiers`, with grpoflow's defaults where the block sets
    none: one interception server (grpoflow answers its model turns), every seat's harness program in a
    local subprocess, and the tool-less `null` chat loop for a taskset that ships no harness (verifiers'
    own default, `bash`, runs the model's shell commands on this host); and an episode deadline
    (`timeout.episode`, EPISODE_TIMEOUT_S; verifiers has none)."""
    require()
    from verifiers.v1.configs.agent import agent_config_fields
    from verifiers.v1.runtimes import SubprocessConfig
    from verifiers.v1.utils.loaders import default_harness_id, harness_config_type, resolve_env_config

    extend_sys_path()  # an environment package beside the config
    block = dict(block)
    interception = block.setdefault("interception", {"type": "server"})
    if not isinstance(interception, dict) or interception.get("type", "server") != "server":
        raise ValueError(
            "tools.verifiers.interception: grpoflow answers every model turn through one interception server; "
            "leave it out (or type: server)"
        )
    cfg = resolve_env_config(block)
    if cfg.timeout.episode is None:  # a hung harness or tool fails its episode, never the batch
        cfg.timeout.episode = EPISODE_TIMEOUT_S
    default = default_harness_id(cfg.taskset.id)
    for spec in agent_config_fields(cfg).values():
        if "runtime" not in spec.model_fields_set:
            spec.runtime = SubprocessConfig()
        if spec.harness is None and default == "bash":
            spec.harness = harness_config_type("null").model_validate({"id": "null"})
    return cfg


class _Envs:
    """Loaded environments, one per concurrent batch (an `Env` serves one batch at a time), by block."""

    def __init__(self) -> None:
        self.free: dict[str, list[Any]] = {}
        self.lock = threading.Lock()

    @contextlib.contextmanager
    def take(self, block: dict[str, Any]):
        require()
        key = json.dumps(block, sort_keys=True, default=str)
        with self.lock:
            pool = self.free.setdefault(key, [])
            env = pool.pop() if pool else None
        if env is None:
            from verifiers.v1.utils.loaders import load_environment

            env = load_environment(env_config(block))
        try:
            yield env
        finally:
            with self.lock:
                self.free[key].append(env)


ENVS = _Envs()


def task_rows(block: dict[str, Any], n: int) -> list[dict[str, Any]]:
    """The taskset's tasks as rows: all of a bounded taskset, the first `n` of an infinite one. A row
    carries the task's data (`vf_task`, its JSON), its key as `id`, and its prompt as grpoflow shows it."""
    with ENVS.take(block) as env:
        taskset = env.taskset
        tasks = list(taskset if taskset.bounded else taskset.take(n))
    rows = []
    for task in tasks:
        data = task.data
        prompt = data.prompt if isinstance(data.prompt, str) or data.prompt is None else _wire(data.prompt)
        rows.append({"prompt": prompt or "", "id": f"vf-{task.key}", "vf_task": data.model_dump_json()})
    return rows


def reward_specs(block: dict[str, Any]) -> list[tuple[str, float]]:
    """(name, weight) of each reward the taskset's tasks record: their `@vf.reward` methods, plugged
    rewards and judges, as verifiers scores them."""
    with ENVS.take(block) as env:
        task = next(iter(env.taskset.take(1)), None)
    if task is None:
        raise ValueError("tools.verifiers: the taskset has no task")
    out = [(fn.__name__, float(getattr(fn, "_vf_weight", 1.0))) for fn in task.hooks("reward")]
    out += [(j.reward_name, float(j.config.weight)) for j in task.plugged_judges()]
    return out


def _wire(messages: Any) -> list[dict[str, Any]]:
    from verifiers.v1.dialects.chat import message_to_wire

    return [{k: v for k, v in message_to_wire(m).items() if v is not None} for m in messages]


def _task_of(env: Any, row: dict[str, Any]) -> Any:
    task_cls = type(env.taskset).task_type()
    return task_cls(task_cls.data_type().model_validate_json(row["vf_task"]), env.taskset.config.task)


def _ensure_uv() -> None:
    """verifiers starts harness programs with `uv`: this environment's, when it is not on PATH."""
    here = os.path.dirname(sys.executable)
    if shutil.which("uv") is None and shutil.which("uv", path=here):
        os.environ["PATH"] = here + os.pathsep + os.environ.get("PATH", "")


def _child_paths() -> None:
    """A user's environment package beside the config reaches verifiers' tool-server processes."""
    from grpoflow.tasks.config.imports import search_dirs

    have = os.environ.get("PYTHONPATH", "").split(os.pathsep)
    add = [d for d in search_dirs() if d not in have]
    if add:
        os.environ["PYTHONPATH"] = os.pathsep.join([p for p in have if p] + add)


class _LocksPerLoop(dict):
    """verifiers' subprocess runtime keeps the locks of its harness programs' setup in one class-level dict
    shared by every event loop of the process, while grpoflow runs each batch on a loop of its own (two at
    once when generation runs ahead): an `asyncio.Lock` bound to one loop fails on another. Here each
    loop gets its own."""

    def __init__(self) -> None:
        super().__init__()
        self.loops: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def setdefault(self, key, default=None):
        return self.loops.setdefault(asyncio.get_running_loop(), {}).setdefault(key, default)


def _locks_per_loop() -> None:
    from verifiers.v1.runtimes.subprocess import SubprocessRuntime

    if not isinstance(SubprocessRuntime._locks, _LocksPerLoop):  # the second internal (module doc)
        SubprocessRuntime._locks = _LocksPerLoop()


@contextlib.asynccontextmanager
async def serving(block: dict[str, Any]):
    """One batch's environment, serving (its shared tool servers and interception server up)."""
    _ensure_uv()
    _child_paths()
    _locks_per_loop()
    with ENVS.take(block) as env:
        async with env.serving():
            yield env


class HistoryRewritten(ValueError):
    """The harness sent a conversation that does not extend the episode's last one."""


@dataclass
class _Session:
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
        self.sessions: dict[str, _Session] = {}
        self.unavailable: InferenceUnavailableError | None = None

    async def get_response(self, dialect, body, sampling, session_id=None, turn=None, headers=None):
        from verifiers.v1.clients.train import tool_to_wire

        s = self.sessions.setdefault(session_id or "", _Session())
        if turn is not None:
            messages, tools = turn.prompt, turn.tools
        else:
            request = dialect.parse_request(body)
            messages, tools = request.messages, request.tools
        self._extend(s, _wire(messages), [tool_to_wire(t) for t in tools or []] or None)
        r = self.r
        limit = min(r.gen.max_tokens, r.budget - sum(s.mask), r.max_len - len(s.ids))
        if getattr(sampling, "max_tokens", None):
            limit = min(limit, sampling.max_tokens)
        if len(s.turns) >= r.gen.max_turns or limit <= 0:
            s.truncation = s.truncation or (
                "max_turns" if len(s.turns) >= r.gen.max_turns else "token_budget"
            )
            return _response(body["model"], "", [], "length", len(s.ids), [], [])
        before = list(s.ids)
        t0 = time.perf_counter()
        try:
            (ch,), version = await complete_served(
                r, s.ids, max_tokens=limit, n=1, seed=sample_seed(r.seed, self.index, self.sample, len(s.turns)),
                **r.sample_kwargs(),
            )  # fmt: skip
        except InferenceUnavailableError as e:  # no server left: the group goes to another (generate.py)
            self.unavailable = e
            raise
        s.version = version if s.version is None else s.version
        ids, lps = list(ch.token_ids), list(ch.logprobs)
        s.turns.append(TurnRecord(len(s.ids), len(ids), time.perf_counter() - t0, ch.finish_reason, ids, lps))
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
        return _response(body["model"], content, calls, finish, len(before), before, (ids, lps))

    def _extend(self, s: _Session, wire: list[dict[str, Any]], schemas: list[dict[str, Any]] | None) -> None:
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

    def _calls(self, s: _Session, text: str) -> list[Any]:
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


def _response(model: str, content, calls, finish: str, prompt_len: int, prompt_ids, sampled) -> Any:
    from verifiers.v1.clients.train import serialize_completion
    from verifiers.v1.types import AssistantMessage, Response, TurnTokens, Usage

    ids, lps = sampled if sampled else ([], [])
    out = Response(
        id=f"grpoflow-{uuid.uuid4().hex[:12]}",
        created=int(time.time()),
        model=model,
        message=AssistantMessage(content=content or None, tool_calls=calls or None),
        finish_reason=finish,
        usage=Usage(prompt_tokens=prompt_len, completion_tokens=len(ids)),
        tokens=TurnTokens.model_construct(
            prompt_ids=list(prompt_ids), completion_ids=list(ids), completion_logprobs=list(lps)
        ),
    )
    out.raw = serialize_completion(out, model)
    return out


_CLIENT_CLASS: type | None = None


def _client(r: RolloutSettings, index: int, sample: int) -> PolicyClient:
    global _CLIENT_CLASS
    if _CLIENT_CLASS is None:
        vf = require()
        _CLIENT_CLASS = type("PolicyClient", (PolicyClient, vf.Client), {"__module__": __name__})
    return _CLIENT_CLASS(r, index, sample)


async def verifiers_rollout(r: RolloutSettings, env: Any, row: dict[str, Any], index: int, sample: int):
    """One episode of the row's task as a rollout: verifiers runs it (harness, tools, its scoring) with
    this rollout's `PolicyClient`; the policy's turns become the completion, verifiers' verdict its
    `VerifiersOutcome`."""
    from verifiers.v1.env import RunSlot
    from verifiers.v1.interception.server import InterceptionServer

    vf = require()
    client = _client(r, index, sample)
    # A config of its own (an unused header makes its key unique): the interception server hands this
    # rollout's turns to this client; the address is never called (the client generates itself).
    config = vf.TrainClientConfig(
        base_url="http://127.0.0.1:9/v1",
        api_key_var="GRPOFLOW_UNUSED",
        headers={"X-Grpoflow-Rollout": uuid.uuid4().hex},
    )
    server = env._interception
    if not isinstance(server, InterceptionServer):
        raise TypeError(
            f"tools.verifiers: expected verifiers' InterceptionServer, got {type(server).__name__}"
        )
    key = config.model_dump_json()
    server.clients[key] = client
    t0, v0 = time.perf_counter(), r.version_fn()
    try:
        episode = await env.run_slot(
            RunSlot(_task_of(env, row)), vf.ModelContext(model="policy", client=config)
        )
    finally:
        server.clients.pop(key, None)
    if client.unavailable is not None:
        raise client.unavailable
    return _completion(r, client, episode, sample, row, v0, time.perf_counter() - t0)


def _completion(r, client: PolicyClient, episode: Any, sample: int, row: dict, v0: int, seconds: float):
    outcome: VerifiersOutcome = outcome_of(episode)
    ids = {t.id for t in episode.traces}
    used = [s for sid, s in client.sessions.items() if sid in ids and s.turns]
    if len(used) > 1 and outcome.error is None:
        outcome.error = (
            f"{len(used)} seats of the episode called the policy; grpoflow trains one sequence per rollout"
        )
    s = used[0] if used else _Session()
    if not used:  # the harness never asked: nothing to train; its cells say why (outcome.error)
        s.prompt_text = (
            row["prompt"] if isinstance(row["prompt"], str) else render(r.tok, row["prompt"], None, True)
        )
        s.ids = r.tok.encode(s.prompt_text, add_special_tokens=False)
        s.prompt_len, s.truncation = len(s.ids), "no_model_turn"
        outcome.error = outcome.error or "the episode made no model turn"
    c = RolloutCompletion(
        sample_index=sample,
        completion="",
        completion_ids=s.ids[s.prompt_len :],
        completion_mask=s.mask,
        logprobs=s.lps,
        messages=s.msgs,
        turns=s.turns,
        tool_calls=s.calls,
        truncated=s.truncation is not None,
        truncation_reason=s.truncation,
        finish_reason=s.finish,
        policy_version=v0 if s.version is None else s.version,
        policy_version_end=r.version_fn(),
        gen_seconds=seconds,
    )
    c.completion = r.text(c.completion_ids)
    c.prompt_ids, c.prompt, c.prompt_input = s.ids[: s.prompt_len], s.prompt_text, row["prompt"]
    c.verifiers = outcome
    return c


async def gather_episodes(r: RolloutSettings, env: Any, row: dict, index: int, bounded) -> list[Any]:
    """The group: G episodes of the row's task, concurrently."""
    return list(
        await asyncio.gather(
            *(bounded(verifiers_rollout(r, env, row, index, i)) for i in range(r.gen.group_size))
        )
    )

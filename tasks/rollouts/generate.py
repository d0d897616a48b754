"""Rollout generation: groups of G completions, multi-turn tool calls, stateful environments.

Token sequence of a completion: prompt | model output (mask 1) | tool result + template glue
(mask 0) | model output (mask 1) | ... Model tokens are never re-tokenised: the ids vLLM sampled are
the ids we train on, and the behaviour logprobs line up with them one to one.
"""

from __future__ import annotations

import asyncio
import copy
import functools
import inspect
import time
from collections.abc import Callable
from typing import Any

from grpoflow.storage.faults import failpoint
from grpoflow.storage.records import RolloutCompletion, RolloutGroup, TaggedMessage, TurnRecord, row_id_of
from grpoflow.tasks.config.imports import import_object
from grpoflow.tasks.config.rollouts import GenerationConfig, ToolsConfig
from grpoflow.tasks.rollouts.inference import (
    Choice,
    InferenceHTTPError,
    InferenceUnavailableError,
    cache_salt_for,
)
from grpoflow.tasks.rollouts.replicas import Servers
from grpoflow.tasks.rollouts.tools import (
    HermesToolParser,
    ToolBox,
    ToolCallParser,
    environment_tools,
    tool_schema,
)


def prompt_messages(row: dict[str, Any], index: int) -> list[dict[str, Any]]:
    if "prompt" not in row:
        raise ValueError(f"row {index} has no 'prompt' field")
    p = row["prompt"]
    if isinstance(p, str):
        return [{"role": "user", "content": p}]
    if isinstance(p, list) and all(isinstance(m, dict) and "role" in m for m in p):
        return [dict(m) for m in p]
    raise ValueError(f"row {index}: 'prompt' must be a string or a list of chat messages")


def with_system_text(messages: list[dict], text: str) -> list[dict]:
    """`messages` with `text` appended to their system turn, or in a new system turn first."""
    if messages and messages[0].get("role") == "system":
        return [{**messages[0], "content": f"{messages[0]['content']}\n\n{text}"}, *messages[1:]]
    return [{"role": "system", "content": text}, *messages]


def render(tokenizer, messages, schemas, generation_prompt: bool) -> str:
    return tokenizer.apply_chat_template(
        messages, tools=schemas or None, add_generation_prompt=generation_prompt, tokenize=False
    )


def template_ignores_tools(tokenizer, schemas: list[dict]) -> bool:
    probe = [{"role": "user", "content": "?"}]
    return render(tokenizer, probe, schemas, True) == render(tokenizer, probe, None, True)


def tools_in_system_turn(describe_tools: str, tokenizer, schemas: list[dict]) -> bool:
    """Whether the tools and the call format go into the system turn: `tools.describe_tools`
    'system', or 'auto' and the chat template ignores `tools=` (SmolLM2's and many small models'
    templates do; a model that is never told its tools never calls them)."""
    if describe_tools != "auto":
        return describe_tools == "system"
    return template_ignores_tools(tokenizer, schemas)


def with_reset_note(messages: list[dict], note: Any) -> list[dict]:
    """`messages` with an environment's `reset` note (a non-empty string) appended to the last one."""
    if not (isinstance(note, str) and note):
        return messages
    return [*messages[:-1], {**messages[-1], "content": f"{messages[-1]['content']}\n\n{note}"}]


def _seed(seed: int | None, prompt_index: int, sample: int, turn: int) -> int | None:
    if seed is None:
        return None
    return (seed * 1_000_003 + prompt_index * 10_007 + sample * 101 + turn) % (2**31 - 1)


class EnvPool:
    """Environment instances pooled per concurrent slot and reused after `reset`.

    A slot whose tool call timed out is retired: the hung call may still be running on its thread and
    mutating that instance, so it is dropped and a fresh instance takes its place in the pool."""

    def __init__(self, factory: Callable[[], Any], slots: int):
        self.factory, self.slots, self.made = factory, slots, 0
        self.free: asyncio.Queue = asyncio.Queue()

    async def acquire(self) -> Any:
        if self.free.empty() and self.made < self.slots:
            self.made += 1
            return self.factory()
        return await self.free.get()

    def release(self, env: Any) -> None:
        self.free.put_nowait(env)

    def retire(self, env: Any) -> None:
        self.free.put_nowait(self.factory())  # `env` is dropped: its hung call may still write to it


class RolloutSettings:
    """What every rollout of one `generate_groups` call shares: the servers and tokenizer, the
    generation and tools sections (tools resolved to callables), and the environment pool. A group
    runs on a copy bound to one server (`on`): that server's client and the version it serves."""

    def __init__(
        self,
        servers: Servers,
        tokenizer,
        gen: GenerationConfig,
        tools: ToolsConfig,
        *,
        seed: int | None,
        parser: ToolCallParser,
    ):
        self.servers, self.tok, self.gen, self.seed = servers, tokenizer, gen, seed
        self.backend: Any = None  # the bound server's client (`on`)
        self.version_fn: Callable[[], int] = _unbound
        self.budget = gen.max_rollout_tokens or gen.max_tokens * gen.max_turns
        self.tools = [resolve_callable(t) for t in tools.tools]
        # tools.executor ray: plain sync tools run as Ray tasks, called by what the config names
        self.remote_tools = {
            fn.__name__: spec
            for fn, spec in zip(self.tools, tools.tools, strict=True)
            if tools.executor == "ray" and not inspect.iscoroutinefunction(fn)
        }
        self.tool_cpus = tools.num_cpus
        factory = resolve_callable(tools.environment) if tools.environment is not None else None
        self.env_pool = EnvPool(factory, tools.env_slots or gen.max_in_flight) if factory else None
        self.parser, self.tool_timeout_s = parser, tools.tool_timeout_s
        self.describe_tools, self._tools_in_system = tools.describe_tools, None
        self.eos_text = tokenizer.eos_token or ""
        self.max_len = 0

    def on(self, client: Any, version_fn: Callable[[], int]) -> RolloutSettings:
        """These settings bound to one server: its client, and the version of the weights it serves."""
        bound = copy.copy(self)
        bound.backend, bound.version_fn = client, version_fn
        return bound

    def tools_in_system_turn(self, schemas: list[dict]) -> bool:
        """`tools_in_system_turn` for this run's template, decided once (the tools do not change)."""
        if self._tools_in_system is None:
            self._tools_in_system = tools_in_system_turn(self.describe_tools, self.tok, schemas)
        return self._tools_in_system

    @property
    def single_turn(self) -> bool:
        return not self.tools and self.env_pool is None and self.gen.max_turns == 1

    def sample_kwargs(self) -> dict[str, Any]:
        return {"temperature": self.gen.temperature, "top_p": self.gen.top_p}

    def decode(self, ids: list[int]) -> str:
        """The model's raw text, special tokens kept (tool-call parsing, EOS detection)."""
        return self.tok.decode(ids, skip_special_tokens=False)

    def text(self, ids: list[int]) -> str:
        """The completion as rewards and SQL see it: special tokens (EOS, role markers) dropped, as
        TRL and users expect; `finish_reason` says whether the model stopped."""
        return self.tok.decode(ids, skip_special_tokens=True)

    def glue_ids(self, history: list[dict], ended_with_eos: bool, tool_msgs, schemas) -> list[int]:
        """Template tokens between the model's output and the next generation: the closing of the
        assistant turn (minus the EOS the model already produced), tool messages, generation prompt.

        The assistant turn is rendered with a sentinel in place of the model's text and the glue is
        what follows the sentinel: templates that trim or rewrite the content (Llama-3's `| trim`), or
        that render earlier turns differently once more follow, cannot shift it. The model's own
        tokens are kept as sampled, never re-rendered."""
        asst = {"role": "assistant", "content": _SENTINEL}
        full = render(self.tok, history + [asst] + tool_msgs, schemas, True)
        if full.count(_SENTINEL) != 1:
            raise TemplateError(
                "the chat template does not render an assistant message's content verbatim once "
                f"(found it {full.count(_SENTINEL)} times); multi-turn rollouts need that"
            )
        glue = full[full.index(_SENTINEL) + len(_SENTINEL) :]
        if ended_with_eos and self.eos_text and glue.lstrip(" \t").startswith(self.eos_text):
            glue = glue.lstrip(" \t")[len(self.eos_text) :]
        return self.tok.encode(glue, add_special_tokens=False)


def _unbound() -> int:
    raise RuntimeError("RolloutSettings used before `on` bound it to a server")


# Stands in for the assistant's text when rendering glue: plain ASCII with no whitespace, so no
# template filter (trim, strip) alters it, and no tokenizer or model ever sees it.
_SENTINEL = "GRPOFLOWASSISTANTCONTENT8d1f"


class TemplateError(ValueError):
    """The tokenizer's chat template cannot support multi-turn rollouts."""


async def _complete(r: RolloutSettings, ids: list[int], **params: Any) -> tuple[list[Choice], int]:
    """One request under the version the bound server serves now, and that version. It names the
    version's model (`Servers.model_name`: its LoRA adapter, or the server's own) and prefix-cache
    salt, so it is served wholly by that version and never reuses KV computed under other weights.

    An adapter the server no longer holds answers 404: a push retired the version while the request
    was on its way (or being retried). It is asked again under the version served by then."""
    while True:
        version = r.version_fn()
        model = r.servers.model_name(version)
        try:
            out = await r.backend.complete(ids, model=model, cache_salt=cache_salt_for(version), **params)
            return out, version
        except InferenceHTTPError as e:
            if model is None or e.status != 404 or r.version_fn() == version:
                raise


async def _single_turn_group(
    r: RolloutSettings, index: int, prompt_ids: list[int], g: int
) -> list[RolloutCompletion]:
    t0 = time.perf_counter()
    limit = min(r.gen.max_tokens, r.budget, r.max_len - len(prompt_ids))
    choices, v0 = await _complete(
        r, prompt_ids, max_tokens=limit, n=g, seed=_seed(r.seed, index, 0, 0), **r.sample_kwargs()
    )
    v1, dt = r.version_fn(), time.perf_counter() - t0
    out = []
    for i, ch in enumerate(choices):
        text = r.decode(ch.token_ids)
        truncated = ch.finish_reason == "length"
        out.append(
            RolloutCompletion(
                sample_index=i,
                completion=r.text(ch.token_ids),
                completion_ids=list(ch.token_ids),
                completion_mask=[1] * len(ch.token_ids),
                logprobs=list(ch.logprobs),
                messages=[TaggedMessage("assistant", _strip(text, r.eos_text), True)],
                turns=[
                    TurnRecord(
                        len(prompt_ids),
                        len(ch.token_ids),
                        dt,
                        ch.finish_reason,
                        list(ch.token_ids),
                        list(ch.logprobs),
                    )
                ],
                truncated=truncated,
                truncation_reason="max_tokens" if truncated else None,
                finish_reason=ch.finish_reason,
                policy_version=v0,
                policy_version_end=v1,
                gen_seconds=dt,
            )
        )
    return out


def _strip(text: str, eos: str) -> str:
    return text[: -len(eos)] if eos and text.endswith(eos) else text


async def _multi_turn(r: RolloutSettings, row: dict, index: int, sample: int, messages: list[dict]):
    env = None
    tools = {f.__name__: f for f in r.tools}
    history = [dict(m) for m in messages]
    remote = dict(r.remote_tools)
    if r.env_pool is not None:
        env = await r.env_pool.acquire()
        history = with_reset_note(history, env.reset(**row))
        methods = environment_tools(env)  # stateful: they always run here, never on Ray
        tools.update(methods)
        remote = {k: v for k, v in remote.items() if k not in methods}
    # Rewards see the prompt in the row's own form, with this sample's reset note in it.
    prompt_input = history[-1]["content"] if isinstance(row["prompt"], str) else [dict(m) for m in history]
    box = ToolBox(tools, r.tool_timeout_s, remote, r.tool_cpus)
    try:
        c = await _run_turns(r, index, sample, history, box)
        c.prompt_input = prompt_input
        if env is not None:  # snapshot before the slot goes back to the pool and is reset
            c.environment = snapshot(env)
        return c
    finally:
        if env is not None:
            (r.env_pool.retire if box.timed_out else r.env_pool.release)(env)


def snapshot(env: Any) -> Any:
    """An isolated copy of a finished rollout's environment for the reward functions: the
    environment's own `snapshot()` when it defines one, else a deep copy (a shallow copy would share
    lists and dicts with the pooled instance, which the next `reset` rewrites)."""
    own = getattr(env, "snapshot", None)
    return own() if callable(own) else copy.deepcopy(env)


async def _run_turns(r: RolloutSettings, index: int, sample: int, history: list[dict], box: ToolBox):
    schemas = [tool_schema(f) for f in box.tools.values()]
    if schemas and r.tools_in_system_turn(schemas):
        history[:] = with_system_text(history, r.parser.instructions(schemas))
    prompt_text = render(r.tok, history, schemas, True)
    prompt_ids = r.tok.encode(prompt_text, add_special_tokens=False)
    ids, mask, lps, msgs, turns, calls = list(prompt_ids), [], [], [], [], []
    c = RolloutCompletion(
        sample_index=sample, completion="", completion_ids=[], completion_mask=[], logprobs=[]
    )
    c.prompt_ids, c.prompt = prompt_ids, prompt_text
    t_start, c.policy_version = time.perf_counter(), r.version_fn()
    for turn in range(r.gen.max_turns):
        limit = min(r.gen.max_tokens, r.budget - len(mask), r.max_len - len(ids))
        if limit <= 0:
            c.truncated, c.truncation_reason = True, "token_budget" if len(mask) else "prompt_too_long"
            break
        ch = await _turn(r, ids, limit, _seed(r.seed, index, sample, turn), turns)
        ids += ch.token_ids
        mask += [1] * len(ch.token_ids)
        lps += list(ch.logprobs)
        raw = r.decode(ch.token_ids)
        text = _strip(raw, r.eos_text)
        msgs.append(TaggedMessage("assistant", text, True))
        c.finish_reason = ch.finish_reason
        if ch.finish_reason == "length":
            c.truncated, c.truncation_reason = True, "max_tokens"
            break
        parsed = r.parser.parse(text) if box.tools else []
        if not parsed:
            break
        if turn == r.gen.max_turns - 1:
            c.truncated, c.truncation_reason = True, "max_turns"
            break
        records = [await box.call(p, turn) for p in parsed]
        calls += records
        tool_msgs = [{"role": "tool", "name": rec.name, "content": rec.result} for rec in records]
        msgs += [TaggedMessage("tool", rec.result, False) for rec in records]
        glue = r.glue_ids(history, bool(r.eos_text) and raw.endswith(r.eos_text), tool_msgs, schemas)
        history += [{"role": "assistant", "content": text}, *tool_msgs]
        ids += glue
        mask += [0] * len(glue)
        lps += [0.0] * len(glue)
    c.completion_ids, c.completion_mask, c.logprobs = ids[len(prompt_ids) :], mask, lps
    c.completion = r.text(c.completion_ids)
    c.messages, c.turns, c.tool_calls = msgs, turns, calls
    c.policy_version_end, c.gen_seconds = r.version_fn(), time.perf_counter() - t_start
    return c


async def _turn(r: RolloutSettings, ids: list[int], limit: int, seed: int | None, turns: list[TurnRecord]):
    """One generation request of a multi-turn rollout, recorded in `turns`."""
    t0 = time.perf_counter()
    # Each turn reads the version anew: the server's weights may have changed in between.
    (ch,), _ = await _complete(r, ids, max_tokens=limit, n=1, seed=seed, **r.sample_kwargs())
    turns.append(
        TurnRecord(
            len(ids),
            len(ch.token_ids),
            time.perf_counter() - t0,
            ch.finish_reason,
            list(ch.token_ids),
            list(ch.logprobs),
        )
    )
    return ch


async def generate_groups(
    rows: list[dict[str, Any]],
    prompt_indices: list[int],
    *,
    servers: Servers,
    tokenizer,
    generation: GenerationConfig,
    tools: ToolsConfig | None = None,
    seed: int | None = None,
    tool_parser: ToolCallParser | None = None,
    split: str = "train",
) -> list[RolloutGroup]:
    """`generation.group_size` completions for each row, all groups concurrently under
    `generation.max_in_flight` requests; `tools` (functions and/or an environment) make them multi-turn.
    Each group is routed to one of the `servers` and records the version that server serves."""
    if len(rows) != len(prompt_indices):
        raise ValueError(f"{len(rows)} rows but {len(prompt_indices)} prompt indices")
    messages = [prompt_messages(row, i) for row, i in zip(rows, prompt_indices, strict=True)]
    r = RolloutSettings(
        servers,
        tokenizer,
        generation,
        tools or ToolsConfig(),
        seed=seed,
        parser=tool_parser or HermesToolParser(),
    )
    r.max_len = await servers.max_model_len()
    gate = asyncio.Semaphore(generation.max_in_flight)

    async def bounded(coro):
        async with gate:
            return await coro

    groups = [
        _group(r, row, i, m, bounded, split) for row, i, m in zip(rows, prompt_indices, messages, strict=True)
    ]
    return list(await asyncio.gather(*groups))


async def _group(r: RolloutSettings, row: dict, index: int, msgs, bounded, split: str) -> RolloutGroup:
    """One row's group: one n=G request when single-turn, else G concurrent multi-turn rollouts, on the
    least busy server, and again on another if that one fails."""
    comps = await _on_a_server(r, row, index, msgs, bounded)
    failpoint("generate")
    first = comps[0]  # each completion carries its own prompt; the group shows sample 0's
    return RolloutGroup(
        group_id=f"{split}-{index:08d}",
        prompt_index=index,
        prompt=first.prompt,
        prompt_ids=first.prompt_ids,
        completions=list(comps),
        row=row,
        split=split,
        policy_version=min(c.policy_version for c in comps),
        row_id=row_id_of(row),
    )


async def _completions(r: RolloutSettings, row: dict, index: int, msgs, bounded) -> list[RolloutCompletion]:
    G = r.gen.group_size
    if r.single_turn:
        return await _one_prompt_group(r, row, index, msgs, G, bounded)
    return list(await asyncio.gather(*(bounded(_multi_turn(r, row, index, i, msgs)) for i in range(G))))


async def _on_a_server(r: RolloutSettings, row: dict, index: int, msgs, bounded) -> list[RolloutCompletion]:
    """The group's completions from the least busy healthy server; a server that is unreachable for
    good is taken out of the rotation and the whole group is generated again elsewhere (its partial
    completions are dropped). No server left: InferenceUnavailableError."""
    replicas = r.servers.replicas
    while True:
        rep = replicas.pick()
        try:
            comps = await _completions(
                r.on(r.servers.clients[rep.index], rep.versions.get), row, index, msgs, bounded
            )
        except InferenceUnavailableError as e:
            replicas.done(rep, ok=False)
            replicas.down(rep, e)
            continue
        except BaseException:
            replicas.done(rep, ok=False)
            raise
        replicas.done(rep, ok=True)
        for c in comps:
            c.server = rep.url
        return comps


def resolve_callable(obj: str | Callable[..., Any]) -> Callable[..., Any]:
    """A tool or environment factory: an import path 'module:attr', or the callable itself."""
    return import_object(obj) if isinstance(obj, str) else obj


async def _one_prompt_group(r: RolloutSettings, row: dict, index: int, msgs, group_size: int, bounded):
    """Single-turn group: one request with n=G over the shared prompt."""
    text = render(r.tok, msgs, None, True)
    prompt_ids = r.tok.encode(text, add_special_tokens=False)
    if len(prompt_ids) >= r.max_len:
        comps = [_too_long(i, r.version_fn()) for i in range(group_size)]
    else:
        comps = await bounded(_single_turn_group(r, index, prompt_ids, group_size))
    for c in comps:
        c.prompt_ids, c.prompt, c.prompt_input = prompt_ids, text, row["prompt"]
    return comps


def _too_long(sample: int, version: int) -> RolloutCompletion:
    return RolloutCompletion(
        sample_index=sample,
        completion="",
        completion_ids=[],
        completion_mask=[],
        logprobs=[],
        truncated=True,
        truncation_reason="prompt_too_long",
        finish_reason="length",
        policy_version=version,
        policy_version_end=version,
    )


@functools.lru_cache(maxsize=4)
def load_tokenizer(path: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)

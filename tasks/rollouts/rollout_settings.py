"""What every rollout of one `generate_groups` call shares (`RolloutSettings`, bound to one server per
group, and the environment pool), and how a rollout asks its server for tokens (`complete_served`:
under the version that server serves now).
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import inspect
import time
from collections.abc import Callable
from typing import Any

from grpoflow.storage.ids import row_id_of
from grpoflow.storage.records import RolloutCompletion, TurnRecord
from grpoflow.tasks.config.rollouts import GenerationConfig, ToolsConfig
from grpoflow.tasks.rollouts.cache_salt import cache_salt_for
from grpoflow.tasks.rollouts.inference_api import Choice, InferenceHTTPError
from grpoflow.tasks.rollouts.openenv import resolve_environment
from grpoflow.tasks.rollouts.replicas import Servers
from grpoflow.tasks.rollouts.templates import tools_in_system_turn
from grpoflow.tasks.rollouts.tools import ToolCallParser, resolve_callable


def sample_seed(seed: int | None, prompt_index: int, sample: int, turn: int) -> int | None:
    """A request's seed, fixed by the run's `seed` and distinct per prompt, sample and turn (None: unseeded)."""
    if seed is None:
        return None
    return (seed * 1_000_003 + prompt_index * 10_007 + sample * 101 + turn) % (2**31 - 1)


class EnvPool:
    """Environment instances pooled per concurrent slot and reused after `reset`.

    A slot whose tool call timed out is retired: the hung call may still be running on its thread and
    mutating that instance, so it is dropped and a fresh instance takes its place in the pool. An
    instance with `aclose()` (an environment server's session) is closed as it is dropped, and every
    pooled one once the batch is done (`aclose_all`)."""

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

    async def retire(self, env: Any) -> None:
        self.free.put_nowait(self.factory())  # `env` is dropped: its hung call may still write to it
        await _aclose(env)

    async def aclose_all(self) -> None:
        while not self.free.empty():
            await _aclose(self.free.get_nowait())


async def _aclose(env: Any) -> None:
    close = getattr(env, "aclose", None)
    if callable(close):
        with contextlib.suppress(Exception):  # closing a broken session is all that is left to do
            async with asyncio.timeout(10):
                await close()


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
        # An instance pool per environment, by the name a row's `environment` column gives (None: the one)
        slots = tools.env_slots or gen.max_in_flight
        self.env_pools = {
            name: EnvPool(resolve_environment(f), slots) for name, f in tools.environments().items()
        }
        self.env_reward = tools.environment_reward  # call get_reward() where an environment has one
        # MCP servers (tasks/rollouts/mcp_tools.py); the shared connections' tools, once generate_groups opened them
        self.mcp, self.mcp_shared = list(tools.mcp), {}
        # A verifiers environment's [env] block (tasks/rollouts/verifiers_env.py); the batch's env, serving
        self.verifiers, self.verifiers_env = tools.verifiers, None
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
        return (
            not self.tools
            and not self.env_pools
            and not self.mcp
            and not self.verifiers
            and self.gen.max_turns == 1
        )

    def env_pool(self, row: dict) -> EnvPool | None:
        """The pool of the environment `row`'s rollouts use: the one, or the one its `environment` column
        names (TRL's dict form); None without environments."""
        if None in self.env_pools or not self.env_pools:
            return self.env_pools.get(None)
        name = row.get("environment")
        if name not in self.env_pools:  # preflight refuses such rows; a row built by hand gets this
            raise ValueError(
                f"row {row_id_of(row)}: environment {name!r} is not one of tools.environment's: {sorted(self.env_pools)}"
            )
        return self.env_pools[name]

    def sample_kwargs(self) -> dict[str, Any]:
        g = self.gen
        # top_k, min_p and repetition_penalty go only when set away from their defaults: a request of a
        # run that leaves them is the same request as before they existed.
        filters = {k: getattr(g, k) for k in ("top_k", "min_p", "repetition_penalty")}
        return {
            "temperature": g.temperature,
            "top_p": g.top_p,
            "stop": g.stop,
            "stop_token_ids": g.stop_token_ids,
        } | {k: v for k, v in filters.items() if v != type(g).model_fields[k].default}

    def decode(self, ids: list[int]) -> str:
        """The model's raw text, special tokens kept (tool-call parsing, EOS detection)."""
        return self.tok.decode(ids, skip_special_tokens=False)

    def text(self, ids: list[int]) -> str:
        """The completion as rewards and SQL see it: special tokens (EOS, role markers) dropped, as
        TRL and users expect; `finish_reason` says whether the model stopped."""
        return self.tok.decode(ids, skip_special_tokens=True)


def _unbound() -> int:
    raise RuntimeError("RolloutSettings used before `on` bound it to a server")


async def complete_served(r: RolloutSettings, ids: list[int], **params: Any) -> tuple[list[Choice], int]:
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


def strip_eos(text: str, eos: str) -> str:
    return text[: -len(eos)] if eos and text.endswith(eos) else text


async def request_turn(
    r: RolloutSettings, ids: list[int], limit: int, seed: int | None, turns: list[TurnRecord]
) -> tuple[Choice, int]:
    """One generation request of a multi-turn rollout (grpoflow's own, or a verifiers episode's), recorded
    in `turns`, and the version that served it."""
    t0 = time.perf_counter()
    # Each turn reads the version anew: the server's weights may have changed in between.
    (ch,), version = await complete_served(r, ids, max_tokens=limit, n=1, seed=seed, **r.sample_kwargs())
    ids_out, lps = list(ch.token_ids), list(ch.logprobs)
    turns.append(TurnRecord(len(ids), len(ids_out), time.perf_counter() - t0, ch.finish_reason, ids_out, lps))
    return ch, version


def unrun_completion(
    sample: int, version: int, truncation_reason: str, finish_reason: str
) -> RolloutCompletion:
    """A sample that never reached the model (a prompt too long, an environment that could not start):
    nothing generated, recorded as truncated for `truncation_reason`."""
    return RolloutCompletion(
        sample_index=sample,
        completion="",
        completion_ids=[],
        completion_mask=[],
        logprobs=[],
        truncated=True,
        truncation_reason=truncation_reason,
        finish_reason=finish_reason,
        policy_version=version,
        policy_version_end=version,
    )

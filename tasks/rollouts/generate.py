"""Rollout generation: groups of G completions, each group on one server (and again on another if that
one fails); a single-turn group is one n=G request. Multi-turn rollouts (tool calls, environments)
are in tasks/rollouts/multi_turn.py, what every rollout shares in rollout_settings.py, prompts and chat
templates in templates.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any

from grpoflow.storage.faults import failpoint
from grpoflow.storage.ids import row_id_of
from grpoflow.storage.records import RolloutCompletion, RolloutGroup, TaggedMessage, TurnRecord
from grpoflow.tasks.config.rollouts import GenerationConfig, ToolsConfig
from grpoflow.tasks.rollouts.inference_api import InferenceUnavailableError
from grpoflow.tasks.rollouts.mcp_tools import mcp_tools
from grpoflow.tasks.rollouts.multi_turn import multi_turn_rollout
from grpoflow.tasks.rollouts.replicas import Servers
from grpoflow.tasks.rollouts.rollout_settings import (
    RolloutSettings,
    complete_served,
    sample_seed,
    strip_eos,
    unrun_completion,
)
from grpoflow.tasks.rollouts.templates import plain_text_ids, prompt_messages, render
from grpoflow.tasks.rollouts.tools import HermesToolParser, ToolCallParser
from grpoflow.tasks.rollouts.verifiers_env import gather_episodes


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
    try:
        async with (
            mcp_tools([s for s in r.mcp if not s.per_rollout]) as shared,  # one connection a server
            _verifiers(r),
        ):
            r.mcp_shared = shared
            return list(await asyncio.gather(*groups))
    finally:  # environment servers' sessions end with the batch
        for pool in r.env_pools.values():
            await pool.aclose_all()


@contextlib.asynccontextmanager
async def _verifiers(r: RolloutSettings):
    """A verifiers environment serving the batch (tools.verifiers), set on `r` for its rollouts."""
    if r.verifiers is None:
        yield
        return
    from grpoflow.tasks.rollouts.verifiers_env import serving

    async with serving(r.verifiers) as env:
        r.verifiers_env = env
        try:
            yield
        finally:
            r.verifiers_env = None


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
    if r.verifiers_env is not None:  # G episodes of the row's verifiers task
        return await gather_episodes(r, r.verifiers_env, row, index, bounded)
    if r.single_turn:
        return await _one_prompt_group(r, row, index, msgs, G, bounded)
    return list(
        await asyncio.gather(*(bounded(multi_turn_rollout(r, row, index, i, msgs)) for i in range(G)))
    )


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


async def _one_prompt_group(r: RolloutSettings, row: dict, index: int, msgs, group_size: int, bounded):
    """Single-turn group: one request with n=G over the shared prompt, a plain-text one as it is (TRL's
    rule), a conversational one through the chat template."""
    if isinstance(row["prompt"], str):
        text = row["prompt"]
        prompt_ids = plain_text_ids(r.tok, text)
    else:
        text = render(r.tok, msgs, None, True)
        prompt_ids = r.tok.encode(text, add_special_tokens=False)
    if len(prompt_ids) >= r.max_len:
        comps = [unrun_completion(i, r.version_fn(), "prompt_too_long", "length") for i in range(group_size)]
    else:
        comps = await bounded(_single_turn_group(r, index, prompt_ids, group_size))
    for c in comps:
        c.prompt_ids, c.prompt, c.prompt_input = prompt_ids, text, row["prompt"]
    return comps


async def _single_turn_group(
    r: RolloutSettings, index: int, prompt_ids: list[int], g: int
) -> list[RolloutCompletion]:
    t0 = time.perf_counter()
    limit = min(r.gen.max_tokens, r.budget, r.max_len - len(prompt_ids))
    choices, v0 = await complete_served(
        r, prompt_ids, max_tokens=limit, n=g, seed=sample_seed(r.seed, index, 0, 0), **r.sample_kwargs()
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
                messages=[TaggedMessage("assistant", strip_eos(text, r.eos_text), True)],
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

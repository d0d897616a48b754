"""Multi-turn rollouts: tool calls and stateful environments, one request per turn.

Token sequence of a completion: prompt | model output (mask 1) | tool result + template glue
(mask 0) | model output (mask 1) | ... Model tokens are never re-tokenised: the ids vLLM sampled are
the ids we train on, and the behaviour logprobs line up with them one to one.
"""

from __future__ import annotations

import asyncio
import copy
import inspect
import time
from typing import Any

from grpoflow.storage.records import RolloutCompletion, TaggedMessage
from grpoflow.tasks.rewards.env_reward import EnvReward, call_get_reward, has_reward
from grpoflow.tasks.rollouts.mcp_tools import mcp_tools
from grpoflow.tasks.rollouts.openenv import EnvironmentUnavailableError
from grpoflow.tasks.rollouts.rollout_settings import (
    RolloutSettings,
    request_turn,
    sample_seed,
    strip_eos,
    unrun_completion,
)
from grpoflow.tasks.rollouts.templates import glue_ids, render, with_reset_note, with_system_text
from grpoflow.tasks.rollouts.tools import ToolBox, environment_tools, tool_schema


async def multi_turn_rollout(r: RolloutSettings, row: dict, index: int, sample: int, messages: list[dict]):
    own = [s for s in r.mcp if s.per_rollout]
    if not own:
        return await _rollout(r, row, index, sample, messages, r.mcp_shared)
    async with mcp_tools(own) as tools:  # MCP servers that keep state per session: a connection of its own
        return await _rollout(r, row, index, sample, messages, {**r.mcp_shared, **tools})


async def _rollout(r: RolloutSettings, row: dict, index: int, sample: int, messages: list[dict], mcp: dict):
    env, pool = None, r.env_pool(row)
    tools = {f.__name__: f for f in r.tools} | mcp
    history = [dict(m) for m in messages]
    remote = dict(r.remote_tools)
    if pool is not None:
        env = await pool.acquire()
        try:
            note = await _reset(env, row, r.tool_timeout_s)
        except EnvironmentUnavailableError as e:  # a server's session: data, not a bug
            await pool.retire(env)
            return _unavailable(r, sample, history, row, str(e))
        history = with_reset_note(history, note)
        if not history[-1]["content"]:  # no dataset, and reset() gave no prompt: a bug of every row
            pool.release(env)
            raise ValueError(
                f"tools.environment: {type(env).__name__}.reset() returned no prompt, and the run has no "
                "dataset (data.generator: null): reset() must return the prompt"
            )
        methods = environment_tools(env)  # stateful: they always run here, never on Ray
        tools.update(methods)
        remote = {k: v for k, v in remote.items() if k not in methods}
    # Rewards see the prompt in the row's own form, with this sample's reset note in it.
    prompt_input = history[-1]["content"] if isinstance(row["prompt"], str) else [dict(m) for m in history]
    box, reward_timed_out, ok = ToolBox(tools, r.tool_timeout_s, remote, r.tool_cpus), False, False
    try:
        c = await _run_turns(r, index, sample, history, box, env)
        c.prompt_input = prompt_input
        if env is not None and r.env_reward and has_reward(env):  # TRL's get_reward(), on this instance
            c.environment_reward = got = await call_get_reward(env, r.tool_timeout_s)
            reward_timed_out = got.status == "timeout"
        if env is not None:  # snapshot before the slot goes back to the pool and is reset
            c.environment = snapshot(env)
        ok = True
        return c
    finally:
        if env is not None:  # an instance a hung call may still write to is dropped, never reused
            if ok and not (box.timed_out or reward_timed_out or getattr(env, "broken", None)):
                pool.release(env)
            else:
                await pool.retire(env)


async def _reset(env: Any, row: dict, timeout_s: float) -> Any:
    """`env.reset(**row)`; an `async def` one (an environment server's session) under `timeout_s`."""
    out = env.reset(**row)
    if inspect.isawaitable(out):
        try:
            async with asyncio.timeout(timeout_s):
                out = await out
        except TimeoutError:
            raise EnvironmentUnavailableError(f"reset() exceeded {timeout_s}s") from None
    return out


def _unavailable(
    r: RolloutSettings, sample: int, history: list[dict], row: dict, why: str
) -> RolloutCompletion:
    """The rollout of a session that could not start: nothing generated, its environment reward failed."""
    text = render(r.tok, history, None, True)
    version = r.version_fn()
    c = unrun_completion(sample, version, "environment_unavailable", "abort")
    c.prompt, c.prompt_ids = text, r.tok.encode(text, add_special_tokens=False)
    c.prompt_input = row["prompt"]
    c.environment_reward = EnvReward(None, "failed", f"the environment's session failed: {why}"[:500])
    return c


def snapshot(env: Any) -> Any:
    """An isolated copy of a finished rollout's environment for the reward functions: the
    environment's own `snapshot()` when it defines one, else a deep copy (a shallow copy would share
    lists and dicts with the pooled instance, which the next `reset` rewrites)."""
    own = getattr(env, "snapshot", None)
    return own() if callable(own) else copy.deepcopy(env)


async def _run_turns(
    r: RolloutSettings, index: int, sample: int, history: list[dict], box: ToolBox, env: Any
):
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
        ch, _ = await request_turn(r, ids, limit, sample_seed(r.seed, index, sample, turn), turns)
        ids += ch.token_ids
        mask += [1] * len(ch.token_ids)
        lps += list(ch.logprobs)
        raw = r.decode(ch.token_ids)
        text = strip_eos(raw, r.eos_text)
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
        glue = glue_ids(
            r.tok, r.eos_text, history, bool(r.eos_text) and raw.endswith(r.eos_text), tool_msgs, schemas
        )
        history += [{"role": "assistant", "content": text}, *tool_msgs]
        ids += glue
        mask += [0] * len(glue)
        lps += [0.0] * len(glue)
        if getattr(env, "done", False) is True or getattr(env, "broken", None):
            break  # the environment ended the episode (OpenEnv's `done`), or its session broke
    c.completion_ids, c.completion_mask, c.logprobs = ids[len(prompt_ids) :], mask, lps
    c.completion = r.text(c.completion_ids)
    c.messages, c.turns, c.tool_calls = msgs, turns, calls
    c.policy_version_end, c.gen_seconds = r.version_fn(), time.perf_counter() - t_start
    return c

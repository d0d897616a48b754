"""Multi-turn rollouts on the real vLLM server, stored in Parquet and queried with SQL."""

from __future__ import annotations

import json

import pytest
from transformers import AutoTokenizer

from grpoflow.examples.tools import calculator
from grpoflow.storage.rollouts import RolloutStore
from grpoflow.storage.sql import query
from grpoflow.tasks.config.rewards import RewardConfig
from grpoflow.tasks.config.rollouts import GenerationConfig, ToolsConfig
from grpoflow.tasks.rewards.score import score_groups_async
from grpoflow.tasks.rollouts.generate import generate_groups
from grpoflow.tasks.rollouts.inference import VLLMClient
from grpoflow.tasks.rollouts.inference_api import Choice
from grpoflow.tasks.rollouts.replicas import Replica, ReplicaSet, Servers

pytestmark = pytest.mark.integration


class FirstTurnScripted:
    """Wraps the REAL client; only the first turn's output is REPLACED by a scripted tool call
    (a random tiny model never writes valid JSON), every later turn is real vLLM generation."""

    def __init__(self, client: VLLMClient, tok):
        self.client, self.tok = client, tok

    async def max_model_len(self) -> int:
        return await self.client.max_model_len()

    async def complete(self, prompt_ids, **kw):
        if "<tool_response>" in self.tok.decode(prompt_ids):
            return await self.client.complete(prompt_ids, **kw)
        call = '<tool_call>{"name": "calculator", "arguments": {"expression": "6*7"}}</tool_call>'
        ids = self.tok.encode(call, add_special_tokens=False) + [self.tok.eos_token_id]
        return [Choice(ids, [-0.1] * len(ids), "stop", call)]


async def test_multi_turn_tool_rollouts_round_trip_through_parquet_and_sql(
    vllm_server, tiny_model_dir, tmp_path
):
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    async with VLLMClient(vllm_server.url) as client:
        groups = await generate_groups([{"prompt": "What is 6*7?", "answer": 42}], [0], servers=Servers(ReplicaSet([Replica(0, vllm_server.url)]), [FirstTurnScripted(client, tok)]), tokenizer=tok, generation=GenerationConfig(group_size=3, max_tokens=16, max_turns=2, max_rollout_tokens=400), tools=ToolsConfig(tools=[calculator]), seed=0)  # fmt: skip
    await score_groups_async(
        groups, [RewardConfig(name="n", fn="grpoflow.examples.rewards:exact_number", required=False)]
    )
    (g,) = groups
    for c in g.completions:
        assert c.tool_calls[0].result == "42" and not c.tool_calls[0].failed
        assert [m.role for m in c.messages][:2] == ["assistant", "tool"] and c.num_turns == 2
        assert 0 in c.completion_mask and c.completion_mask[-1] == 1  # tool glue masked, real output trained
    store = RolloutStore(tmp_path)
    store.write_rollouts("mt", 0, groups)
    store.write_rewards("mt", 0, groups)
    (back,) = store.read_groups("mt")
    assert [c.completion_ids for c in back.completions] == [c.completion_ids for c in g.completions]
    assert [c.tool_calls for c in back.completions] == [c.tool_calls for c in g.completions]
    _, rows = query(tmp_path, "SELECT name, arguments, result, failed FROM tool_calls ORDER BY sample_index")
    assert rows == [("calculator", json.dumps({"expression": "6*7"}), "42", False)] * 3
    _, rows = query(tmp_path, "SELECT count(*) FROM rewards WHERE reward_name = 'n'")
    assert rows == [(3,)]

"""`generation.stop` and `generation.stop_token_ids` on the real vLLM server: greedy completions (no
sampling luck) end where the stop string or token first appears in the same prompt's completion
without them, finish_reason 'stop', tokens and logprobs ending where vLLM stopped."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from grpoflow.tasks.config.rollouts import GenerationConfig, ToolsConfig
from grpoflow.tasks.rollouts.generate import generate_groups
from grpoflow.tasks.rollouts.inference import VLLMClient
from grpoflow.tasks.rollouts.replicas import Replica, ReplicaSet, Servers

pytestmark = pytest.mark.integration

ROWS = [{"prompt": "Write a word like banana with many letters a."}]


async def _greedy(url: str, tok, **stop):
    generation = GenerationConfig(group_size=2, max_tokens=40, temperature=0.0, **stop)
    async with VLLMClient(url) as client:
        servers = Servers(ReplicaSet([Replica(0, url)]), [client])
        (g,) = await generate_groups(ROWS, [0], servers=servers, tokenizer=tok, generation=generation,
                                     tools=ToolsConfig(), seed=0)  # fmt: skip
    return g.completions


async def test_a_stop_string_or_token_ends_the_completion_where_it_first_appears(vllm_server, tiny_model_dir):
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    (full, _) = await _greedy(vllm_server.url, tok)
    ids = full.completion_ids
    assert len(ids) == 40 and full.finish_reason == "length", "the greedy completion runs to max_tokens"

    # A stop string: two tokens of the greedy completion's middle (byte-level: one character each).
    word = tok.decode(ids[10:12])
    end = full.completion.index(word) + len(word)  # its first appearance ends the completion
    for c in await _greedy(vllm_server.url, tok, stop=[word]):
        assert c.finish_reason == "stop" and c.completion_ids == ids[: len(c.completion_ids)]
        assert c.completion == full.completion[:end]
        assert c.logprobs == full.logprobs[: len(c.completion_ids)] and len(c.completion_mask) == len(
            ids[:end]
        )

    # A stop token: the completion ends with its first appearance, kept as the last token.
    token = ids[15]
    first = ids.index(token)
    for c in await _greedy(vllm_server.url, tok, stop_token_ids=[token]):
        assert c.finish_reason == "stop" and c.completion_ids == ids[: first + 1]
        assert c.turns[0].finish_reason == "stop"

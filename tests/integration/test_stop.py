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
    generation = GenerationConfig(group_size=1, max_tokens=40, temperature=0.0, **stop)  # greedy: n=1
    async with VLLMClient(url) as client:
        servers = Servers(ReplicaSet([Replica(0, url)]), [client])
        (g,) = await generate_groups(ROWS, [0], servers=servers, tokenizer=tok, generation=generation,
                                     tools=ToolsConfig(), seed=0)  # fmt: skip
    return g.completions


async def test_a_stop_string_or_token_ends_the_completion_where_it_first_appears(vllm_server, tiny_model_dir):
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    (full,) = await _greedy(vllm_server.url, tok)
    ids = full.completion_ids
    assert len(ids) >= 16, "the greedy completion is long enough to cut"

    # A stop string: two tokens of the greedy completion's middle. vLLM checks the text it detokenizes
    # (special tokens kept, as grpoflow asks): the completion ends with the token that completes its
    # first appearance.
    word = tok.decode(ids[10:12], skip_special_tokens=False)
    k = next(k for k in range(len(ids)) if word in tok.decode(ids[: k + 1], skip_special_tokens=False))
    (c,) = await _greedy(vllm_server.url, tok, stop=[word])
    assert c.finish_reason == "stop" and c.completion_ids == ids[: k + 1]
    assert c.logprobs == full.logprobs[: k + 1] and c.completion_mask == [1] * (k + 1)

    # A stop token: the completion ends with its first appearance, kept as the last token.
    token = ids[15]
    first = ids.index(token)
    (c,) = await _greedy(vllm_server.url, tok, stop_token_ids=[token])
    assert c.finish_reason == "stop" and c.completion_ids == ids[: first + 1]
    assert c.turns[0].finish_reason == "stop"

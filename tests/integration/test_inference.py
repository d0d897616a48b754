"""The real vLLM CPU server: generation matches transformers, weight push in flight, faults."""

from __future__ import annotations

import asyncio
import functools
import struct

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from grpoflow.flows.processes.launch import ServerStartError
from grpoflow.flows.processes.serve import start_server
from grpoflow.tasks.config.inference import InferenceConfig, SyncConfig
from grpoflow.tasks.push.push import push_version, weight_push
from grpoflow.tasks.push.weights import save_weights
from grpoflow.tasks.rollouts.inference import VLLMClient
from grpoflow.tasks.rollouts.inference_api import InferenceHTTPError, InferenceUnavailableError
from grpoflow.tasks.rollouts.replicas import Replica, ReplicaSet
from tests.support import server_metric, until_running

pytestmark = pytest.mark.integration


def hf_logprobs(model, prompt_ids, out_ids):
    x = torch.tensor([prompt_ids + out_ids])
    with torch.no_grad():
        lp = torch.log_softmax(model(x).logits[0, len(prompt_ids) - 1 : -1].float(), -1)
    return lp, lp.gather(-1, torch.tensor(out_ids).unsqueeze(-1)).squeeze(-1)


@pytest.fixture(scope="module")
def tok(tiny_model_dir):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


def prompt(tok, text="hello there"):
    rendered = tok.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False
    )
    return tok.encode(rendered, add_special_tokens=False)


async def test_greedy_tokens_and_logprobs_match_transformers(vllm_server, tiny_model_dir, tok):
    ids = prompt(tok)
    async with VLLMClient(vllm_server.url) as c:
        (ch,) = await c.complete(ids, max_tokens=24, temperature=0.0)
        assert await c.max_model_len() == 1024
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    lp, picked = hf_logprobs(model, ids, ch.token_ids)
    assert lp.argmax(-1).tolist() == ch.token_ids
    assert (picked - torch.tensor(ch.logprobs)).abs().max() < 1e-3
    assert len(ch.token_ids) == len(ch.logprobs) and ch.finish_reason in {"stop", "length"}


async def test_seed_makes_sampling_reproducible(vllm_server, tok):
    ids = prompt(tok, "seeds")
    async with VLLMClient(vllm_server.url) as c:
        a = await c.complete(ids, max_tokens=16, temperature=1.0, seed=11, n=4)
        b = await c.complete(ids, max_tokens=16, temperature=1.0, seed=11, n=4)
        other = await c.complete(ids, max_tokens=16, temperature=1.0, seed=12, n=4)
    assert [x.token_ids for x in a] == [x.token_ids for x in b]
    assert [x.token_ids for x in a] != [x.token_ids for x in other]


async def test_a_long_prompts_logprobs_follow_neither_its_batch_nor_its_cached_prefix(vllm_server):
    """The bits of a 600-token prompt's completion are the same alone, prefilled in one step with prompts
    of 200 and 700 tokens, and with its prefix cached. Before grpoflow.server.invariant cut prefills into
    pieces, vLLM's CPU attention tiled a prompt's queries by the work of the whole step (its rows 480-491
    came out otherwise beside these two), and the logprobs differed from the 11th token on."""

    def ids(n: int, k: int) -> list[int]:
        return [3 + (7 * i + 13 * k) % 90 for i in range(n)]

    async with VLLMClient(vllm_server.url) as c:

        async def bits(prompt: list[int], salt: str) -> tuple[list[int], list[bytes]]:
            (ch,) = await c.complete(
                prompt, max_tokens=24, seed=1, ignore_eos=True, cache_salt=salt, temperature=1.0
            )
            return ch.token_ids, [struct.pack("<f", x) for x in ch.logprobs]

        alone = await bits(ids(600, 0), "invariant-alone")
        beside, *_ = await asyncio.gather(
            *(bits(ids(n, k), f"invariant-beside-{k}") for k, n in enumerate((600, 200, 700)))
        )
        cached = await bits(ids(600, 0), "invariant-alone")
    assert beside == alone
    assert cached == alone


async def test_weight_push_while_a_request_is_in_flight(vllm_server, tiny_model_dir, tok, tmp_path):
    ids = prompt(tok, "push")
    perturbed = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    with torch.no_grad():
        for p in perturbed.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    servers = ReplicaSet([Replica(0, vllm_server.url)])  # the push flips its version
    pusher = weight_push(tmp_path, "push-test", SyncConfig(), InferenceConfig())
    async with VLLMClient(vllm_server.url) as gen, VLLMClient(vllm_server.url) as ctl:
        # A long request (temperature 1, EOS possible but 900 tokens allowed) runs across the push.
        v_start = servers.replicas[0].versions.get()
        long = asyncio.create_task(gen.complete(ids, max_tokens=900, temperature=1.0, seed=3))
        await until_running(vllm_server.url)  # the server says it generates it: the push comes mid-request
        write = functools.partial(save_weights, perturbed)
        stats = await asyncio.to_thread(push_version, pusher, write, 1, servers)
        (done,) = await long
        v_end = servers.replicas[0].versions.get()
        assert done.token_ids and (v_start, v_end) == (0, 1)  # completed, and its span is recorded
        assert stats.total_seconds >= stats.reload_seconds > 0
        assert not await ctl.is_paused()
        (ch,) = await gen.complete(ids, max_tokens=16, temperature=0.0)
    lp, picked = hf_logprobs(perturbed, ids, ch.token_ids)
    assert lp.argmax(-1).tolist() == ch.token_ids
    assert (picked - torch.tensor(ch.logprobs)).abs().max() < 1e-3
    assert sorted(p.name for p in (tmp_path / "weights" / "push-test").iterdir()) == ["v000001"]


async def test_too_long_prompt_is_a_400_with_the_servers_message(vllm_server):
    def refused() -> float:  # the server's own count of the completions it answered 4xx
        return server_metric(vllm_server.url, "http_requests_total", handler="/v1/completions", status="4xx")

    before = refused()
    async with VLLMClient(vllm_server.url, retries=3) as c:
        with pytest.raises(InferenceHTTPError) as e:
            await c.complete(list(range(100)) * 12, max_tokens=4)
    assert refused() == before + 1  # sent once: no retries (and so no backoff)
    assert e.value.status == 400 and "maximum context length" in e.value.body


async def test_server_not_started_gives_a_clear_error_quickly():
    from grpoflow.flows.processes.launch import free_port

    url = f"http://127.0.0.1:{free_port()}"
    async with VLLMClient(url, retries=2, backoff_s=0.05) as c:
        # each attempt refused at once (no connect timeout waited out), then the error names them
        with pytest.raises(
            InferenceUnavailableError, match="after 3 attempts; last error: ClientConnectorError"
        ):
            await c.complete([1, 2, 3], max_tokens=2)


def test_server_that_cannot_start_shows_its_log(tmp_path):
    bad = tmp_path / "not-a-model"
    bad.mkdir()
    with pytest.raises(ServerStartError, match="exited with code") as e:
        start_server(bad, log_path=tmp_path / "bad.log", startup_timeout_s=120)
    assert "last log lines" in str(e.value)


def test_non_loopback_bind_requires_an_api_key(tiny_model_dir):
    with pytest.raises(ValueError, match="without an API key"):
        start_server(tiny_model_dir, host="0.0.0.0")

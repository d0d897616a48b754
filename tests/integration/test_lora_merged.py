"""The `lora_merged` weight push against the real vLLM CPU server (the shared one, started as full
fine-tuning runs start theirs: no --enable-lora): a version's adapter, merged into the served weights
by the server's worker extension, generates what peft's merge_and_unload run by transformers
generates; merges never accumulate; a failed merge leaves the server on the version before; a LoRA run
trains through it.

Greedy decoding on fixed prompts: no assertion depends on sampling luck."""

from __future__ import annotations

import asyncio
import json

import pytest

from grpoflow.tasks.config.inference import InferenceConfig, SyncConfig
from grpoflow.tasks.push.push import (
    MergedLoraPush,
    WeightPushError,
    load_version,
    push_version,
)
from grpoflow.tasks.rollouts.inference import VLLMClient
from grpoflow.tasks.rollouts.inference_api import InferenceError, no_such_method
from grpoflow.tasks.rollouts.replicas import Replica, ReplicaSet
from tests.integration.test_lora_push import merged_greedy, peft_model, served_greedy
from tests.support import REPO

pytestmark = pytest.mark.integration


def pusher_for(root, run_id: str) -> MergedLoraPush:
    return MergedLoraPush(root, run_id, SyncConfig(backend="lora_merged", keep_last=2), InferenceConfig())


async def test_a_merged_adapter_generates_what_the_merged_model_does_and_merges_never_add_up(
    vllm_server, tmp_path
):
    from grpoflow.tasks.learner.lora import write_adapter

    base = await served_greedy(vllm_server.url, None)
    pusher, servers = pusher_for(tmp_path, "merged"), ReplicaSet([Replica(0, vllm_server.url)])
    for version, seed in ((1, 1), (2, 2)):
        model = peft_model(vllm_server.model_dir, seed=seed)
        stats = await asyncio.to_thread(
            push_version, pusher, lambda d, m=model: write_adapter(m, d), version, servers
        )
        assert stats.failed_servers == 0 and servers.replicas[0].versions.get() == version
        # v2 is the base with adapter 2 alone: each merge starts from the base model's files.
        expected = await asyncio.to_thread(merged_greedy, vllm_server.model_dir, servers.weights_path)
        assert await served_greedy(vllm_server.url, pusher.model_name(version)) == expected != base
    assert pusher.model_name(2) is None  # requests name the server's own model
    # Only adapters travelled; keep_last holds.
    kept = sorted(p.name for p in (tmp_path / "weights" / "merged").glob("v*"))
    assert kept == ["v000001", "v000002"]
    assert not list((tmp_path / "weights").rglob("model.safetensors"))


async def test_a_failed_merge_leaves_the_server_serving_the_version_before(vllm_server, tmp_path):
    from safetensors.torch import load_file, save_file

    from grpoflow.tasks.learner.lora import write_adapter

    pusher, servers = pusher_for(tmp_path, "merge-fail"), ReplicaSet([Replica(0, vllm_server.url)])
    model = peft_model(vllm_server.model_dir, seed=1)
    await asyncio.to_thread(push_version, pusher, lambda d: write_adapter(model, d), 1, servers)
    v1 = await served_greedy(vllm_server.url, None)
    # An adapter for a module the base model does not have (another model's adapter).
    bad = tmp_path / "bad"
    write_adapter(model, bad)
    tensors = load_file(bad / "adapter_model.safetensors")
    save_file(
        {k.replace("layers.0.", "layers.99."): v for k, v in tensors.items()},
        bad / "adapter_model.safetensors",
    )
    with pytest.raises(WeightPushError) as e:
        await asyncio.to_thread(load_version, pusher, vllm_server.url, bad, 2)
    assert "weight push v2" in str(e.value) and "rolled the server back" in str(e.value), e.value
    assert await served_greedy(vllm_server.url, None) == v1


async def test_a_server_without_a_method_answers_so(vllm_server):
    """What `no_such_method` reads, as the real server answers it (a server started without the merge
    extension answers `grpoflow_merge_lora` the same way)."""
    async with VLLMClient(vllm_server.url) as c:
        with pytest.raises(InferenceError) as e:
            await c.collective_rpc("grpoflow_no_such_method", {}, 60)
    assert no_such_method(e.value, "grpoflow_no_such_method") and not no_such_method(
        e.value, "reload_weights"
    )


def test_a_lora_merged_run_serves_its_last_adapter_merged(tmp_path, vllm_server, tiny_model_dir, prefect_api):
    from grpoflow.flows.config import load_config
    from grpoflow.flows.training.train import grpo_train
    from grpoflow.storage.sql import query

    steps = 3
    cfg = load_config(REPO / "configs" / "tiny-letters.yaml", [
        f"storage.root={tmp_path}", f"model.path={tiny_model_dir}", f"inference.url={vllm_server.url}",
        f"run.steps={steps}", "run.run_id=merged-run", "learner.lora={rank: 8, alpha: 16}",
        "learner.lr=0.01", "sync.backend=lora_merged",
    ])  # fmt: skip
    summary = grpo_train(config=cfg)
    assert summary["steps_trained"] == steps
    last = tmp_path / "weights" / "merged-run" / f"v{steps:06d}"
    assert json.loads((last / "adapter_config.json").read_text())["r"] == 8
    assert not list((tmp_path / "weights").rglob("model.safetensors"))
    # What the server serves under its own name is the base with the run's last adapter merged.
    expected = merged_greedy(tiny_model_dir, last)
    assert asyncio.run(served_greedy(vllm_server.url, None)) == expected
    _, rows = query(tmp_path, "SELECT max(policy_version) FROM steps WHERE run_id = 'merged-run'")
    assert rows[0][0] == steps

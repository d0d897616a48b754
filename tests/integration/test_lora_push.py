"""The `lora` weight push against the real vLLM CPU server: a version's adapter, loaded under its name,
generates what the merged model (peft's merge_and_unload, run by transformers) generates; pushes keep
the previous version servable and unload the ones before it.

Greedy decoding on fixed prompts: no assertion depends on sampling luck. The adapters are PEFT's
format as the learner writes them (`tasks.lora.write_adapter`), with lora_B drawn from a fixed seed
(peft starts B at zero: the identity)."""

from __future__ import annotations

import asyncio
import json

import pytest
import torch

from grpoflow.tasks.config.inference import InferenceConfig, SyncConfig
from grpoflow.tasks.config.learner import LORA_TARGETS
from grpoflow.tasks.push.push import LoraPush, push_version
from grpoflow.tasks.rollouts.inference import VLLMClient
from grpoflow.tasks.rollouts.inference_api import InferenceHTTPError
from grpoflow.tasks.rollouts.replicas import Replica, ReplicaSet

pytestmark = pytest.mark.integration

PROMPTS = [[60, 61, 62, 63], [200, 17, 3, 99, 45, 45], [120] * 9]
NEW_TOKENS = 12


def peft_model(base_dir, seed: int):
    """The tiny model with a rank-16 adapter on every projection, lora_B drawn from `seed`."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    config = LoraConfig(r=16, lora_alpha=32, target_modules=list(LORA_TARGETS), task_type="CAUSAL_LM")
    model = get_peft_model(base, config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.2)
    return model


def merged_greedy(base_dir, adapter_dir) -> list[list[int]]:
    """What transformers generates greedily with the adapter merged into the base weights."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    model = PeftModel.from_pretrained(base, str(adapter_dir)).merge_and_unload().eval()
    out = []
    for ids in PROMPTS:
        with torch.no_grad():
            seq = model.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False,
                                 pad_token_id=model.config.pad_token_id)  # fmt: skip
        out.append(seq[0, len(ids) :].tolist())
    return out


async def served_greedy(url: str, model: str | None) -> list[list[int]]:
    async with VLLMClient(url) as c:
        runs = [c.complete(ids, max_tokens=NEW_TOKENS, temperature=0.0, model=model) for ids in PROMPTS]
        return [ch.token_ids for (ch,) in await asyncio.gather(*runs)]


def pusher_for(root, run_id: str) -> LoraPush:
    return LoraPush(root, run_id, SyncConfig(backend="lora", keep_last=2), InferenceConfig())


async def test_a_pushed_adapter_generates_what_the_merged_model_does(lora_server, tmp_path):
    from grpoflow.tasks.learner.lora import write_adapter

    model = peft_model(lora_server.model_dir, seed=1)
    pusher, servers = pusher_for(tmp_path, "merge"), ReplicaSet([Replica(0, lora_server.url)])
    stats = await asyncio.to_thread(push_version, pusher, lambda d: write_adapter(model, d), 1, servers)
    assert stats.failed_servers == 0 and servers.replicas[0].versions.get() == 1
    expected = await asyncio.to_thread(merged_greedy, lora_server.model_dir, servers.weights_path)
    served = await served_greedy(lora_server.url, pusher.model_name(1))
    assert served == expected
    # The adapter is applied: the base model (requests naming no adapter) says something else.
    assert await served_greedy(lora_server.url, None) != served


async def test_a_push_keeps_the_previous_version_servable_and_unloads_the_ones_before(lora_server, tmp_path):
    from grpoflow.tasks.learner.lora import write_adapter

    pusher, servers = pusher_for(tmp_path, "keep"), ReplicaSet([Replica(0, lora_server.url)])
    paths, tokens = {}, {}
    for v, seed in [(1, 11), (2, 12), (3, 13)]:
        model = peft_model(lora_server.model_dir, seed)
        await asyncio.to_thread(push_version, pusher, lambda d, m=model: write_adapter(m, d), v, servers)
        paths[v] = servers.weights_path
        tokens[v] = await served_greedy(lora_server.url, pusher.model_name(v))
    # v2 (the previous version) and v3 are loaded, each still serving its own adapter; v1 is not.
    async with VLLMClient(lora_server.url) as c:
        held = {m["id"]: m.get("root") for m in await c.models() if m["id"].startswith("keep@")}
    assert held == {"keep@v2": paths[2], "keep@v3": paths[3]}
    assert await served_greedy(lora_server.url, "keep@v2") == tokens[2] != tokens[3]
    with pytest.raises(InferenceHTTPError, match="does not exist") as e:
        await served_greedy(lora_server.url, "keep@v1")
    assert e.value.status == 404


def test_grpo_evaluate_scores_a_lora_checkpoint_as_its_base_with_the_adapter(
    lora_server, tmp_path, prefect_api
):
    """A LoRA run's checkpoint holds an adapter, not a model: evaluation loads it through the lora
    push (here into a caller's eval server, on the base's weights whatever the server held) and its
    requests name it."""
    from grpoflow.flows.config import load_config
    from grpoflow.flows.lineage.evaluate import grpo_evaluate
    from grpoflow.storage.checkpoints import CheckpointStore
    from grpoflow.storage.sql import query
    from grpoflow.tasks.learner.lora import write_adapter
    from tests.support import REPO

    model = peft_model(lora_server.model_dir, seed=21)

    def checkpoint(d):
        write_adapter(model, d / "adapter")
        (d / "learner.json").write_text(json.dumps({"base_model": str(lora_server.model_dir)}))

    CheckpointStore(tmp_path).save("lo", 3, checkpoint, {"policy_version": 4})
    cfg = load_config(REPO / "configs" / "tiny-letters.yaml", [
        f"storage.root={tmp_path}", f"model.path={lora_server.model_dir}", "learner.lora={rank: 16}"])  # fmt: skip
    common = {"config": cfg, "prompts": 3, "greedy": True, "server_url": lora_server.url}
    lora = grpo_evaluate(run_id="lo", **common)
    base = grpo_evaluate(checkpoint=str(lora_server.model_dir), eval_run="lo-base-eval", **common)
    assert lora["step"] == 3 and lora["completions"] == base["completions"] == 3
    held = asyncio.run(served_models(lora_server.url))
    assert "lo-eval@v3" in held and held["lo-eval@v3"] == str(
        tmp_path / "checkpoints" / "lo" / "step-000003" / "adapter"
    )

    def completions(run):
        _, rows = query(
            tmp_path, f"SELECT completion FROM rollouts WHERE run_id = '{run}' ORDER BY prompt_index"
        )
        return [r[0] for r in rows]

    assert completions("lo-eval") != completions("lo-base-eval")
    # A caller's server that holds other weights (a run's last, or an adapter merged into them by
    # lora_merged): vLLM's LoRA path would apply the adapter to those; the evaluation loads the base first.
    from transformers import AutoModelForCausalLM

    from grpoflow.tasks.push.push import load_version, weight_push

    other = AutoModelForCausalLM.from_pretrained(lora_server.model_dir, dtype=torch.float32)
    with torch.no_grad():
        for w in other.parameters():
            w.add_(torch.randn(w.shape, generator=torch.Generator().manual_seed(5)) * 0.05)
    other.save_pretrained(tmp_path / "other")
    full = weight_push(tmp_path, "other", SyncConfig(backend="checkpoint"), InferenceConfig())
    try:
        load_version(full, lora_server.url, tmp_path / "other", 1)
        again = grpo_evaluate(run_id="lo", eval_run="lo-eval-again", **common)
        assert again["completions"] == 3 and completions("lo-eval-again") == completions("lo-eval")
    finally:  # the session's server goes back to its base whatever happened
        load_version(full, lora_server.url, lora_server.model_dir, 2)


async def served_models(url: str) -> dict[str, str | None]:
    async with VLLMClient(url) as c:
        return {m["id"]: m.get("root") for m in await c.models()}

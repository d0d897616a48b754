"""The second model family on the real vLLM server: a random Gemma 3 (`tiny_gemma3_dir`: Gemma's own
262k-token tokenizer that adds BOS and has no chat template, tied embeddings, a sliding-window layer
beside a full one, grouped-query attention). A base-model run on plain-text prompts with full-weight
pushes, its export, adapter and merged-adapter pushes, and the server's batch invariance.

Greedy decoding on fixed prompts, or bitwise comparisons of the same seeded requests: no assertion
depends on sampling luck."""

from __future__ import annotations

import asyncio
import json
import struct

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from grpoflow.storage.rollouts import RolloutStore
from grpoflow.tasks.config.inference import InferenceConfig, SyncConfig
from grpoflow.tasks.push.push import LoraPush, MergedLoraPush, load_version, push_version, weight_push
from grpoflow.tasks.rollouts.inference import VLLMClient
from grpoflow.tasks.rollouts.replicas import Replica, ReplicaSet
from tests.integration.test_lora_push import peft_model
from tests.support import Samples, logprob_gap, served_samples, tiny_cfg

pytestmark = pytest.mark.integration

STEPS = 2
QUESTIONS = [
    f"Question: Write one word, in lower case, with {n} letters a in it.\nAnswer:" for n in range(1, 9)
]
# Seeded sampling prompts (BOS first), longer than the model's 16-token sliding window.
PROBES = [[2] + [100 + (7 * i + 13 * k) % 5000 for k in range(12 + 9 * i)] for i in range(3)]


def served(url: str, model: str | None) -> Samples:
    """Seeded samples of the PROBES from the server (under `model`, or its own weights)."""
    return served_samples(url, PROBES, model=model)


gap = logprob_gap


def merged(base_dir, adapter_dir):
    from peft import PeftModel

    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    return PeftModel.from_pretrained(base, str(adapter_dir)).merge_and_unload()


def restore_base(server, root) -> None:
    pusher = weight_push(root, "restore", SyncConfig(), InferenceConfig())
    load_version(pusher, server.url, server.model_dir, 0)


@pytest.fixture
def gemma3_base(gemma3_server, tmp_path_factory):
    """The Gemma 3 server, serving its base weights again (after the run's pushes, or a merge)."""
    restore_base(gemma3_server, tmp_path_factory.mktemp("restore"))
    return gemma3_server


@pytest.fixture(scope="module")
def gemma3_run(gemma3_server, tiny_gemma3_dir, prefect_api, tmp_path_factory):
    """A base-model run: STEPS steps on plain-text prompts, full weights pushed after every step
    (`checkpoint` backend), on-policy (staleness 0), a checkpoint at its last step."""
    from grpoflow.flows.training.train import grpo_train

    root = tmp_path_factory.mktemp("gemma3-run")
    data = root / "questions.jsonl"
    data.write_text("".join(json.dumps({"prompt": q}) + "\n" for q in QUESTIONS))
    cfg = tiny_cfg(root, tiny_gemma3_dir, gemma3_server.url, **{
        "run.run_id": "g3", "run.steps": STEPS, "run.checkpoint_every": STEPS, "data.path": data,
        "data.prompts_per_step": 4, "generation.group_size": 2, "generation.max_tokens": 8,
        "algorithm.max_staleness": 0, "learner.lr": 0.05})  # fmt: skip
    return root, grpo_train(config=cfg)


def test_gemma3_trains_on_plain_text_prompts_with_one_bos_and_its_own_numerics(gemma3_run, tiny_gemma3_dir):
    root, summary = gemma3_run
    assert summary["steps_trained"] == STEPS
    tok = AutoTokenizer.from_pretrained(tiny_gemma3_dir)
    groups = RolloutStore(root).read_groups("g3")
    assert len(groups) == STEPS * 4 and all(len(g.completions) == 2 for g in groups)
    for g in groups:
        # The text as it is, with the one BOS Gemma's tokenizer adds: no template, no second BOS.
        assert g.prompt in QUESTIONS and g.prompt_ids == tok.encode(g.prompt, add_special_tokens=True)
        assert g.prompt_ids[0] == tok.bos_token_id and g.prompt_ids.count(tok.bos_token_id) == 1
        assert tok.decode(g.prompt_ids[1:]) == g.prompt
    # Step 0 was sampled from the base weights: transformers' logprobs of its tokens are the server's
    # (a wrong sliding window, norm, embedding scale or tied head shows as a gap; prompts outgrow the window).
    first = RolloutStore(root).read_groups("g3", 0)
    assert first and len(first[0].prompt_ids) > 16
    assert (
        gap(
            tiny_gemma3_dir,
            [(g.prompt_ids, c.completion_ids, c.logprobs) for g in first for c in g.completions],
        )
        < 1e-3
    )


def test_the_server_serves_the_runs_last_weights_and_the_export_is_a_gemma3_model(gemma3_run, gemma3_server,
                                                                                  tmp_path):  # fmt: skip
    from grpoflow.flows.lineage.export import export_checkpoint

    root, _ = gemma3_run
    exported = export_checkpoint(root, "g3", tmp_path / "export")
    assert exported.kind == "model" and exported.step == STEPS - 1  # steps count from 0
    config = json.loads((exported.out / "config.json").read_text())
    assert config["architectures"] == ["Gemma3ForCausalLM"] and config["tie_word_embeddings"] is True
    tok = AutoTokenizer.from_pretrained(exported.out)
    assert tok.encode("Question")[0] == tok.bos_token_id  # the export keeps the tokenizer's BOS rule
    # The run trained the tied embedding too: the server's LM head is the new embedding (not a pack of
    # the old one kept by vLLM's CPU reload: server/merge.py).
    answers = served(gemma3_server.url, None)
    assert gap(exported.out, answers) < 1e-3
    assert gap(gemma3_server.model_dir, answers) > 1e-2  # the run changed the policy


def test_an_adapter_push_serves_what_the_merged_gemma3_generates(gemma3_base, tmp_path):
    gemma3_server = gemma3_base
    from grpoflow.tasks.learner.lora import write_adapter

    model = peft_model(gemma3_server.model_dir, seed=1)
    pusher = LoraPush(tmp_path, "g3-lora", SyncConfig(backend="lora", keep_last=2), InferenceConfig())
    servers = ReplicaSet([Replica(0, gemma3_server.url)])
    stats = push_version(pusher, lambda d: write_adapter(model, d), 1, servers)
    assert stats.failed_servers == 0
    answers = served(gemma3_server.url, pusher.model_name(1))
    assert gap(merged(gemma3_server.model_dir, servers.weights_path), answers) < 1e-3
    assert gap(gemma3_server.model_dir, answers) > 1e-2  # the adapter changes what is generated


def test_a_merged_adapter_push_serves_the_merged_gemma3(gemma3_base, tmp_path):
    gemma3_server = gemma3_base
    from grpoflow.tasks.learner.lora import write_adapter

    model = peft_model(gemma3_server.model_dir, seed=2)
    pusher = MergedLoraPush(tmp_path, "g3-merged", SyncConfig(backend="lora_merged", keep_last=2),
                            InferenceConfig())  # fmt: skip
    servers = ReplicaSet([Replica(0, gemma3_server.url)])
    stats = push_version(pusher, lambda d: write_adapter(model, d), 1, servers)
    assert stats.failed_servers == 0 and pusher.model_name(1) is None
    answers = served(gemma3_server.url, None)
    assert gap(merged(gemma3_server.model_dir, servers.weights_path), answers) < 1e-3
    assert gap(gemma3_server.model_dir, answers) > 1e-2  # merged into the served weights


async def _answer(c: VLLMClient, ids: list[int], seed: int, salt: str) -> tuple[list[int], list[bytes]]:
    (ch,) = await c.complete(ids, max_tokens=24, seed=seed, cache_salt=salt, ignore_eos=True)
    return ch.token_ids, [struct.pack("<f", x) for x in ch.logprobs]


async def test_a_gemma3_answer_does_not_follow_its_batch(gemma3_base):
    gemma3_server = gemma3_base
    """The batch-invariance plugin on Gemma 3: each seeded request alone, and the same requests all at
    once (prompts longer than the sliding window), give the same tokens and the same logprob bits."""
    prompts = [[2] + [100 + (7 * i + 13 * k) % 5000 for k in range(12 + 9 * i)] for i in range(8)]
    async with VLLMClient(gemma3_server.url) as c:
        alone = [await _answer(c, p, 7 + i, "alone") for i, p in enumerate(prompts)]
        together = await asyncio.gather(*(_answer(c, p, 7 + i, "together") for i, p in enumerate(prompts)))
    assert together == alone

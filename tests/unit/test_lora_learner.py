"""The LoRA learner on the real tiny model (peft): what trains, the KL reference, checkpoints, merging."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from grpoflow.tasks.config.learner import LoraConfig
from grpoflow.tasks.learner.learner_api import TrainSample
from grpoflow.tasks.learner.logprobs import token_logprobs
from grpoflow.tasks.learner.lora import LoraTargetError, check_targets, merge
from tests.support import make_learner
from tests.support import train_samples as samples

pytestmark = pytest.mark.unit

LORA = LoraConfig(rank=8, alpha=16)


def logprobs(model, s: TrainSample) -> torch.Tensor:
    ids = torch.tensor([s.input_ids], device=model.device)
    with torch.no_grad():
        return token_logprobs(model, ids, torch.ones_like(ids), 1.0)[0]


def seq_logprob(model, s: TrainSample) -> float:
    picked = logprobs(model, s)[s.prompt_len - 1 :].tolist()
    return float(sum(v for v, m in zip(picked, s.completion_mask, strict=True) if m))


def lora_learner(tiny_model_dir, **fields):
    return make_learner(
        tiny_model_dir, total_steps=10, lr=fields.pop("lr", 1e-2), lora=LORA, seed=0, **fields
    )


def test_only_the_adapter_trains_and_the_base_stays_as_it_was(tiny_model_dir):
    learner = lora_learner(tiny_model_dir, loss_type="dapo")
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).to(learner.device)
    # A new adapter is the identity: before any update the policy is the base model.
    for s in samples():
        assert torch.equal(logprobs(learner.model, s), logprobs(base, s))
    names = [n for n, p in learner.model.named_parameters() if p.requires_grad]
    assert names and all("lora_" in n for n in names)
    frozen = {n: p.detach().clone() for n, p in learner.model.named_parameters() if not p.requires_grad}
    before = [seq_logprob(learner.model, s) for s in samples()]
    learner.train_step(samples())
    after = [seq_logprob(learner.model, s) for s in samples()]
    assert after[0] > before[0] and after[1] < before[1] and after[2] > before[2]
    assert all(torch.equal(p, frozen[n]) for n, p in learner.model.named_parameters() if n in frozen)
    # Optimizer state exists for the adapter's tensors alone.
    assert len(learner.optimizer.state) == len(names) == len(learner.trainable)
    assert sum(p.numel() for p in learner.trainable) < learner.num_parameters / 4


def test_the_kl_reference_is_the_base_model_with_the_adapter_disabled(tiny_model_dir):
    learner = lora_learner(tiny_model_dir, beta=0.1)
    assert learner.ref_model is None  # no second copy in memory
    learner.train_step(samples())
    learner.train_step(samples())
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).to(learner.device)
    s = samples()[0]
    mb = [s]
    ref = learner._reference_logprobs(mb)
    policy = learner._micro_batch(learner.model, mb).logprobs
    expected = logprobs(base, s)[s.prompt_len - 1 :]
    assert torch.allclose(ref[0, : len(expected)], expected, atol=1e-6)
    assert not torch.allclose(policy, ref, atol=1e-4)  # the adapter moved the policy away from it


def test_a_checkpoint_holds_the_adapter_and_resumes_identically(tiny_model_dir, tmp_path):
    a = lora_learner(tiny_model_dir, lr=1e-3, lr_schedule="cosine", warmup_steps=2)
    a.train_step(samples())
    a.save(tmp_path)
    assert (tmp_path / "adapter" / "adapter_config.json").is_file()
    assert (tmp_path / "adapter" / "adapter_model.safetensors").is_file()
    assert not (tmp_path / "model").exists()  # no copy of the base model
    b = lora_learner(
        tiny_model_dir, lr=1e-3, lr_schedule="cosine", warmup_steps=2, adapter_path=tmp_path / "adapter"
    )
    b.load_trainer_state(tmp_path)
    ma, mb = a.train_step(samples()), b.train_step(samples())
    assert ma["train/loss"] == pytest.approx(mb["train/loss"]) and ma["train/lr"] == mb["train/lr"]
    for pa, pb in zip(a.trainable, b.trainable, strict=True):
        assert torch.allclose(pa, pb, atol=1e-7)


def test_pushed_adapter_is_peft_format_and_merges_into_the_same_policy(tiny_model_dir, tmp_path):
    learner = lora_learner(tiny_model_dir)
    learner.train_step(samples())
    learner.write_weights(tmp_path / "v1")
    assert sorted(p.name for p in (tmp_path / "v1").iterdir()) == [
        "adapter_config.json",
        "adapter_model.safetensors",
    ]
    merged = AutoModelForCausalLM.from_pretrained(
        merge(tiny_model_dir, tmp_path / "v1", tmp_path / "merged"), dtype=torch.float32
    ).to(learner.device)
    for s in samples():
        assert torch.allclose(logprobs(merged, s), logprobs(learner.model, s), atol=1e-5)


def test_target_modules_must_name_linear_layers_of_the_model(tiny_model_dir):
    check_targets(tiny_model_dir, LoraConfig())  # the default: attention and MLP projections
    with pytest.raises(LoraTargetError, match=r"learner\.lora\.target_modules: \['qkv'\].*q_proj"):
        check_targets(tiny_model_dir, LoraConfig(target_modules=["q_proj", "qkv"]))
    with pytest.raises(LoraTargetError, match="embed_tokens"):  # an embedding, not a linear layer
        check_targets(tiny_model_dir, LoraConfig(target_modules=["embed_tokens"]))

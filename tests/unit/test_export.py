"""`grpoflow export`: checkpoints of real learners (tiny model, LoRA and full) out as dirs transformers and
peft load, through the command line."""

from __future__ import annotations

import pytest
import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM, AutoTokenizer

from grpoflow.flows.cli.main import main
from grpoflow.storage.checkpoints import CheckpointStore
from grpoflow.storage.rollouts import RolloutStore
from grpoflow.tasks.config.learner import LoraConfig
from grpoflow.tasks.learner.learner_api import TrainSample
from grpoflow.tasks.learner.logprobs import token_logprobs
from tests.support import make_learner

pytestmark = pytest.mark.unit

SAMPLES = [
    TrainSample([5, 6, 7, 70, 71, 72], 3, [1, 1, 1], [-5.5] * 3, 1.0),
    TrainSample([5, 6, 7, 80, 81], 3, [1, 1], [-5.5, -5.5], -1.0),
]
PROBE = torch.tensor([[5, 6, 7, 70, 71, 72, 9, 9]])


def logprobs(model) -> torch.Tensor:
    with torch.no_grad():
        return token_logprobs(model, PROBE, torch.ones_like(PROBE), 1.0)


def same_tokenizer(a, b) -> bool:
    ta, tb = AutoTokenizer.from_pretrained(a), AutoTokenizer.from_pretrained(b)
    return (
        ta.get_vocab() == tb.get_vocab()
        and ta.eos_token == tb.eos_token
        and ta.chat_template == tb.chat_template
    )


def trained_run(root, run_id, tiny_model_dir, steps=(0, 1), **fields):
    """A run in the store whose checkpoints hold a learner after 1, 2, ... steps; the learner."""
    learner = make_learner(tiny_model_dir, total_steps=5, lr=1e-2, tokenizer_path=tiny_model_dir, **fields)
    RolloutStore(root).write_run_meta(run_id, {"run_id": run_id, "status": "completed"})
    for step in steps:
        learner.train_step(SAMPLES)
        CheckpointStore(root).save(run_id, step, learner.save, {"policy_version": step + 1})
    return learner


def test_a_lora_run_exports_its_adapter_and_a_merged_model_transformers_loads(
    tiny_model_dir, tmp_path, capsys
):
    learner = trained_run(tmp_path / "store", "lora-run", tiny_model_dir, lora=LoraConfig(rank=8))
    want = logprobs(learner.model)
    root = ["--root", str(tmp_path / "store")]

    assert main(["export", "lora-run", "--out", str(tmp_path / "adapter"), *root]) == 0
    assert "step 1: LoRA adapter (PEFT)" in capsys.readouterr().out
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    assert torch.allclose(logprobs(PeftModel.from_pretrained(base, tmp_path / "adapter")), want, atol=1e-6)

    assert main(["export", "lora-run", "--merge", "--out", str(tmp_path / "merged"), *root]) == 0
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged")  # plain transformers, no peft
    assert torch.allclose(logprobs(merged), want, atol=1e-5)
    assert same_tokenizer(tmp_path / "merged", tiny_model_dir)

    # --step picks an earlier checkpoint: one update, not two.
    assert main(["export", "lora-run", "--step", "0", "--merge", "--out", str(tmp_path / "s0"), *root]) == 0
    first = AutoModelForCausalLM.from_pretrained(tmp_path / "s0")
    assert not torch.allclose(logprobs(first), want, atol=1e-5)


def test_a_full_fine_tuning_run_exports_its_checkpoint_model(tiny_model_dir, tmp_path):
    learner = trained_run(tmp_path / "store", "full-run", tiny_model_dir, steps=(0,))
    out = tmp_path / "out"
    assert main(["export", "full-run", "--out", str(out), "--root", str(tmp_path / "store")]) == 0
    assert torch.allclose(
        logprobs(AutoModelForCausalLM.from_pretrained(out)), logprobs(learner.model), atol=1e-6
    )
    assert same_tokenizer(out, tiny_model_dir)


def test_bad_export_requests_are_one_error_line(tiny_model_dir, tmp_path, capsys):
    root = tmp_path / "store"
    trained_run(root, "r", tiny_model_dir, steps=(0,), lora=LoraConfig(rank=8))
    capsys.readouterr()  # the learner's own progress lines
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("keep me")
    cases = [
        (["export", "nope", "--out", str(tmp_path / "a")], "RUN: no run 'nope'"),
        (["export", "r", "--step", "7", "--out", str(tmp_path / "a")], "no checkpoint at step 7; it has [0]"),
        (["export", "r", "--out", str(tmp_path / "full")], "exists and is not an empty directory"),
    ]
    for argv, message in cases:
        assert main([*argv, "--root", str(root)]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("error: ") and message in err[0]
    assert (tmp_path / "full" / "x").read_text() == "keep me"
    assert not (tmp_path / "a").exists()

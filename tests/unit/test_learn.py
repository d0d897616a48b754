"""The Learner on the real tiny model: direction of updates, micro-batching, checkpoint resume."""

from __future__ import annotations

import pytest
import torch

from grpoflow.tasks.learner.learn import Learner
from grpoflow.tasks.learner.learner_api import TrainSample
from grpoflow.tasks.learner.logprobs import logprobs_from, shared_prompt_logprobs, token_logprobs
from tests.support import make_learner
from tests.support import train_samples as samples

pytestmark = pytest.mark.unit


def seq_logprob(learner: Learner, s: TrainSample) -> float:
    ids = torch.tensor([s.input_ids], device=learner.device)
    with torch.no_grad():
        lp = token_logprobs(learner.model, ids, torch.ones_like(ids), learner.temperature)[0]
    picked = lp[s.prompt_len - 1 :]
    return float(sum(v for v, m in zip(picked.tolist(), s.completion_mask, strict=True) if m))


def test_update_moves_logprobs_in_the_advantage_direction(tiny_model_dir):
    learner = make_learner(tiny_model_dir, lr=1e-2, total_steps=10, loss_type="dapo", seed=0)
    before = [seq_logprob(learner, s) for s in samples()]
    m = learner.train_step(samples())
    after = [seq_logprob(learner, s) for s in samples()]
    assert after[0] > before[0] and after[1] < before[1] and after[2] > before[2]
    assert m["train/tokens"] == 8 and m["train/grad_norm"] > 0 and m["train/samples"] == 3


def test_micro_batching_gives_the_same_update(tiny_model_dir):
    # Compare the accumulated gradients (Adam's first step would amplify float noise in tiny grads).
    grads, losses = [], []
    for mbs in (1, 3):
        learner = make_learner(
            tiny_model_dir, lr=1e-3, total_steps=10, loss_type="grpo", micro_batch_size=mbs, seed=0
        )
        learner.optimizer.step = lambda: None
        losses.append(learner.train_step(samples())["train/loss"])
        grads.append(torch.cat([p.grad.flatten() for p in learner.model.parameters()]))
    assert losses[0] == pytest.approx(losses[1], rel=1e-5)
    assert torch.allclose(grads[0], grads[1], rtol=1e-4, atol=1e-7)


def test_checkpoint_resume_continues_identically(tiny_model_dir, tmp_path):
    a = make_learner(tiny_model_dir, lr=1e-3, total_steps=10, lr_schedule="cosine", warmup_steps=2, seed=0)
    a.train_step(samples())
    a.save(tmp_path)
    b = make_learner(
        tmp_path / "model",
        lr=1e-3,
        total_steps=10,
        lr_schedule="cosine",
        warmup_steps=2,
        seed=0,
        tokenizer_path=tiny_model_dir,
    )
    b.load_trainer_state(tmp_path)
    ma, mb = a.train_step(samples()), b.train_step(samples())
    assert ma["train/loss"] == pytest.approx(mb["train/loss"]) and ma["train/lr"] == mb["train/lr"]
    for pa_, pb in zip(a.model.parameters(), b.model.parameters(), strict=True):
        assert torch.allclose(pa_, pb, atol=1e-6)


def test_a_resume_with_another_learning_rate_uses_it_from_the_schedules_place(tiny_model_dir, tmp_path):
    a = make_learner(tiny_model_dir, lr=1e-3, total_steps=4, lr_schedule="linear", seed=0)
    a.train_step(samples())
    a.save(tmp_path)
    b = make_learner(tmp_path / "model", lr=4e-3, total_steps=4, lr_schedule="linear", seed=0,
                     tokenizer_path=tiny_model_dir)  # fmt: skip
    b.load_trainer_state(tmp_path)
    assert b.train_step(samples())["train/lr"] == pytest.approx(4e-3 * 3 / 4)  # update 1 of 4, linear


def test_lr_schedule_is_transformers_warm_up_from_zero_then_decay(tiny_model_dir):
    # transformers.get_scheduler: warm-up lr(k) = peak * k / warmup for update k = 0, 1, ..., so the
    # first update runs at lr 0 (grpoflow's own schedule used (k + 1) / warmup before).
    learner = make_learner(tiny_model_dir, lr=1e-3, total_steps=6, warmup_steps=2, lr_schedule="linear")
    learner.optimizer.step = lambda: None  # the schedule alone
    used = [learner.train_step(samples())["train/lr"] for _ in range(6)]
    assert used == pytest.approx([0.0, 5e-4, 1e-3, 7.5e-4, 5e-4, 2.5e-4])


def test_empty_batch_is_a_skipped_step(tiny_model_dir):
    learner = make_learner(tiny_model_dir, lr=1e-3, total_steps=1)
    assert learner.train_step([])["train/skipped"] == 1.0


def grads_of(learner: Learner) -> torch.Tensor:
    return torch.cat([p.grad.flatten() for p in learner.model.parameters()])


def test_zero_advantage_samples_skip_the_forward_and_leave_the_update_unchanged(tiny_model_dir):
    # A group with no reward signal (advantage 0) among trained ones: same gradient, loss and
    # normaliser with or without its forward/backward pass.
    batch = samples() + [
        TrainSample([5, 6, 7, 75, 76, 77, 78], 3, [1, 1, 1, 1], [-5.5] * 4, 0.0),
        TrainSample([9, 9, 95], 2, [1], [-5.5], 0.0),
    ]
    runs = {}
    for skip in (False, True):
        learner = make_learner(
            tiny_model_dir, lr=1e-3, total_steps=10, loss_type="dapo", seed=0, skip_zero_advantage=skip
        )
        learner.optimizer.step = lambda: None
        runs[skip] = (learner.train_step(batch), grads_of(learner))
    (m_all, g_all), (m_skip, g_skip) = runs[False], runs[True]
    assert m_skip["train/skipped_zero_advantage"] == 2 and m_all["train/skipped_zero_advantage"] == 0
    assert m_skip["train/tokens"] == m_all["train/tokens"] == 13
    assert m_skip["train/loss"] == pytest.approx(m_all["train/loss"], rel=1e-5)
    # atol: a GPU's float32 sums in another order where the skipped samples change the batch's shape
    assert torch.allclose(g_skip, g_all, rtol=1e-4, atol=1e-7)


def test_all_zero_advantages_still_step_adam_like_the_full_pass(tiny_model_dir):
    zero = [
        TrainSample(s.input_ids, s.prompt_len, s.completion_mask, s.behaviour_logprobs, 0.0)
        for s in samples()
    ]
    params = []
    for skip in (False, True):
        learner = make_learner(
            tiny_model_dir, lr=1e-2, total_steps=10, loss_type="dapo", seed=0, skip_zero_advantage=skip
        )
        learner.train_step(samples())
        m = learner.train_step(zero)  # zero gradient, but Adam's moments still move the weights
        assert m["train/loss"] == 0.0 and m["train/skipped_zero_advantage"] == (3 if skip else 0)
        params.append(torch.cat([p.detach().flatten() for p in learner.model.parameters()]))
    assert torch.allclose(params[0], params[1], atol=1e-6)


def test_logits_only_where_completions_are_predicted(tiny_model_dir):
    learner = make_learner(tiny_model_dir, lr=1e-3, total_steps=1)
    ids = torch.tensor([[5, 6, 7, 70, 71, 72, 3], [9, 9, 9, 9, 90, 91, 92]], device=learner.device)
    attn = torch.ones_like(ids)
    with torch.no_grad():
        full = token_logprobs(learner.model, ids, attn, 0.7)
        tail = logprobs_from(learner.model, ids, attn, 0.7, first=3)
    assert tail.shape == (2, 3) and torch.allclose(tail, full[:, 3:], atol=1e-5)


def micro_batch_sizes(learner: Learner, batch: list[TrainSample]) -> list[int]:
    return [len(mb) for update in learner.plan(batch) for mb in update.micro]


def assert_shared_logprobs_match_full_forwards(learner: Learner, batch: list[TrainSample]) -> None:
    """The shared-prompt micro-batch's completion logprobs equal one plain forward per sequence."""
    with torch.no_grad():
        shared = shared_prompt_logprobs(learner.model, batch, temperature=learner.temperature,
                                        pad_id=learner.pad_id, device=learner.device).logprobs  # fmt: skip
        for i, s in enumerate(batch):
            ids = torch.tensor([s.input_ids], device=learner.device)
            full = token_logprobs(learner.model, ids, torch.ones_like(ids), learner.temperature)[0]
            assert torch.allclose(shared[i, : len(s.completion_mask)], full[s.prompt_len - 1 :], atol=1e-5)


def test_shared_prompt_forward_gives_the_same_logprobs_and_update(tiny_model_dir):
    # Two completions share the prompt [5, 6, 7]: with sharing it runs once and its KV cache is
    # repeated; logprobs, loss and gradients match the full-sequence forward.
    runs = {}
    for share in (False, True):
        learner = make_learner(
            tiny_model_dir, lr=1e-3, total_steps=10, loss_type="grpo", seed=0, share_prompt=share
        )
        assert learner.share_prompt is share
        learner.optimizer.step = lambda: None
        runs[share] = (learner.train_step(samples()), grads_of(learner))
    assert micro_batch_sizes(learner, samples()) == [3]  # both prompts, one batch
    assert_shared_logprobs_match_full_forwards(learner, samples()[:2])
    assert runs[True][0]["train/loss"] == pytest.approx(runs[False][0]["train/loss"], rel=1e-5)
    assert torch.allclose(runs[True][1], runs[False][1], rtol=1e-4, atol=1e-7)


def test_prompts_of_different_lengths_share_a_micro_batch_exactly(tiny_model_dir):
    # Three prompts of lengths 3, 2 and 5 in one micro-batch: they run left-padded as one batch with
    # position ids from each prompt's first token; logprobs, loss and gradients match one plain
    # forward per sequence (micro_batch_size 1, no sharing).
    batch = samples() + [
        TrainSample([11, 12, 13, 14, 15, 60, 61, 62], 5, [1, 1, 1], [-5.5] * 3, -0.5),
        TrainSample([11, 12, 13, 14, 15, 63], 5, [1], [-5.5], 0.25),
    ]
    runs = {}
    for share, mbs in ((False, 1), (True, 8)):
        learner = make_learner(tiny_model_dir, lr=1e-3, total_steps=10, loss_type="grpo", seed=0,
                               share_prompt=share, micro_batch_size=mbs)  # fmt: skip
        learner.optimizer.step = lambda: None
        runs[share] = (learner.train_step(batch), grads_of(learner))
    assert micro_batch_sizes(learner, batch) == [5]
    assert_shared_logprobs_match_full_forwards(learner, batch)
    assert runs[True][0]["train/loss"] == pytest.approx(runs[False][0]["train/loss"], rel=1e-5)
    assert torch.allclose(runs[True][1], runs[False][1], rtol=1e-4, atol=1e-7)
    assert torch.isfinite(runs[True][1]).all()


# --- several updates per batch --------------------------------------------------------------------


def weights_of(learner: Learner) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for p in learner.model.parameters()])


def count_forwards(learner: Learner) -> list[int]:
    """Forwards counted by the LM head's calls: one per forward, whichever way it runs."""
    calls = [0]
    learner.model.get_output_embeddings().register_forward_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    return calls


@pytest.mark.parametrize(
    "iterations, minis, forwards, steps",
    [
        (1, 1, 1, 1),  # today's path: one forward, ratio 1 by construction, no pi_old pass
        (2, 1, 2, 2),  # the first pass's forward gives pi_old: no extra forward
        (1, 3, 3 + 2, 3),  # parts 2 and 3 need pi_old before the first update: one extra forward each
    ],
)
def test_forwards_and_optimizer_steps_per_batch(tiny_model_dir, iterations, minis, forwards, steps):
    learner = make_learner(
        tiny_model_dir, lr=1e-3, total_steps=10, num_iterations=iterations, mini_batches=minis
    )
    calls = count_forwards(learner)
    m = learner.train_step(samples())  # 3 samples in one micro-batch, or one per part
    assert calls[0] == forwards and m["train/optimizer_steps"] == steps
    assert learner.scheduler.last_epoch == steps


@pytest.mark.parametrize("share", [False, True])
def test_pi_old_is_the_policy_before_the_first_update(tiny_model_dir, share):
    # With the optimizer switched off the policy never moves: every ratio of every update must be
    # exactly 1, so pi_old taken by the no-grad pass equals what the update's own forward computes.
    learner = make_learner(tiny_model_dir, lr=1e-3, total_steps=10, num_iterations=2, mini_batches=2,
                           share_prompt=share, micro_batch_size=1)  # fmt: skip
    learner.optimizer.step = lambda: None
    m = learner.train_step(samples())
    assert m["train/optimizer_steps"] == 4
    assert m["train/ratio_min"] == m["train/ratio_max"] == 1.0 and m["train/policy_kl"] == 0.0
    assert m["train/iter1/ratio_min"] == m["train/iter1/ratio_max"] == 1.0


def test_the_second_pass_clips_against_the_first_pass_policy(tiny_model_dir):
    # A large step moves the policy: the first pass sees ratio exactly 1 and clips nothing; the
    # second sees the moved policy against pi_old, so its ratios spread and the clip acts.
    learner = make_learner(tiny_model_dir, lr=5e-2, total_steps=10, num_iterations=2, loss_type="dapo")
    m = learner.train_step(samples())
    assert m["train/iter0/ratio_min"] == m["train/iter0/ratio_max"] == 1.0
    assert m["train/iter0/clip_frac_low"] == m["train/iter0/clip_frac_high"] == 0.0
    assert m["train/iter0/policy_kl"] == 0.0 < m["train/iter1/policy_kl"]
    assert m["train/iter1/ratio_max"] > 1.2 or m["train/iter1/ratio_min"] < 0.8, m
    assert m["train/iter1/clip_frac_high"] + m["train/iter1/clip_frac_low"] > 0, m
    assert m["train/clip_frac_high"] + m["train/clip_frac_low"] > 0  # the step's figure averages the passes


def test_gspo_equals_grpo_at_one_update_and_differs_after(tiny_model_dir):
    after = {}
    for iterations in (1, 2):
        for loss_type in ("grpo", "gspo"):
            learner = make_learner(tiny_model_dir, lr=5e-2, total_steps=10, num_iterations=iterations,
                                   loss_type=loss_type)  # fmt: skip
            learner.train_step(samples())
            after[iterations, loss_type] = weights_of(learner)
    assert torch.allclose(after[1, "grpo"], after[1, "gspo"], atol=1e-6)
    assert not torch.allclose(after[2, "grpo"], after[2, "gspo"], atol=1e-4)


def test_lr_schedule_counts_optimizer_steps(tiny_model_dir):
    # 10 training steps x 2 passes x 2 parts = 40 optimizer steps of a linear decay from 1e-3; one
    # training step takes 4 of them: the next step starts at 1e-3 x 36/40.
    learner = make_learner(tiny_model_dir, lr=1e-3, total_steps=10, lr_schedule="linear", num_iterations=2,
                           mini_batches=2)  # fmt: skip
    assert learner.train_step(samples())["train/lr"] == pytest.approx(1e-3)
    assert learner.train_step(samples())["train/lr"] == pytest.approx(1e-3 * 36 / 40)


def test_mini_batches_normalise_each_part_over_itself(tiny_model_dir):
    # dapo with 3 parts of one sample each, optimizer off: each part's loss is its own token mean, so
    # the step's loss (the mean over updates) is the mean of the per-sample token means.
    learner = make_learner(tiny_model_dir, lr=1e-3, total_steps=10, loss_type="dapo", mini_batches=3)
    learner.optimizer.step = lambda: None
    m = learner.train_step(samples())
    singles = []
    for s in samples():
        one = make_learner(tiny_model_dir, lr=1e-3, total_steps=10, loss_type="dapo")
        singles.append(one.train_step([s])["train/loss"])
    assert m["train/loss"] == pytest.approx(sum(singles) / 3, rel=1e-5)


def test_pushed_weights_read_back_exactly_overwritten_in_place_with_tied_tensors_once(tmp_path):
    """The push's safetensors writer: the library reads every tensor back bit for bit (fp32, bf16, a
    0-dim and a strided one); rewriting a file in place with less data leaves exactly the new one; a
    tied LM head is stored once, and transformers loads the directory as the model."""
    from safetensors import safe_open
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, LlamaConfig

    from grpoflow.tasks.push.weights import save_weights, write_safetensors

    path = tmp_path / "t.safetensors"
    write_safetensors({"big": torch.randn(1000)}, path)
    tensors = {"a": torch.randn(3, 5), "b": torch.randn(7).to(torch.bfloat16), "c": torch.tensor(2.5),
               "d": torch.arange(6).reshape(2, 3)[:, 1]}  # fmt: skip
    inode = path.stat().st_ino
    write_safetensors(tensors, path)
    back = load_file(str(path))
    assert path.stat().st_ino == inode and back.keys() == tensors.keys()
    assert all(torch.equal(back[k], v) and back[k].dtype == v.dtype for k, v in tensors.items())

    config = LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=True)  # fmt: skip
    model = AutoModelForCausalLM.from_config(config)
    save_weights(model, tmp_path)
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        assert len(list(f.keys())) == len(dict(model.named_parameters()))  # the tied head once
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    for (name, p), q in zip(model.state_dict().items(), loaded.state_dict().values(), strict=True):
        assert torch.equal(p, q), name


def test_a_resume_restores_every_random_state_from_a_weights_only_file(tiny_model_dir, tmp_path):
    import random

    import numpy as np

    a = make_learner(tiny_model_dir, lr=1e-3, total_steps=4, seed=0)
    a.train_step(samples())
    random.random(), np.random.rand(), torch.rand(1)  # states that differ from any seed's start
    a.save(tmp_path)
    state = torch.load(tmp_path / "trainer_state.pt", weights_only=True)  # no pickled objects
    assert {"python_rng", "torch_rng", "numpy_rng"} <= set(state)
    expected = (random.random(), np.random.rand(), torch.rand(3).tolist())
    b = make_learner(tmp_path / "model", lr=1e-3, total_steps=4, seed=1, tokenizer_path=tiny_model_dir)
    random.seed(7), np.random.seed(7)  # anything else in between
    b.load_trainer_state(tmp_path)
    assert (random.random(), np.random.rand(), torch.rand(3).tolist()) == expected


def test_the_lr_decay_ends_at_the_last_step_when_steps_take_fewer_updates_or_none(tiny_model_dir):
    # 2 training steps x 4 mini-batches = 8 scheduled updates of a linear decay. Three samples make only
    # 3 parts, and an empty batch none: each training step still moves the schedule by 4, so the rate
    # the run would use after its last step is the decay's end, 0.
    learner = make_learner(tiny_model_dir, lr=1e-3, total_steps=2, lr_schedule="linear", mini_batches=4)
    m = learner.train_step(samples())
    assert m["train/optimizer_steps"] == 3 and learner.scheduler.last_epoch == 4
    assert learner.train_step([])["train/skipped"] == 1.0
    assert learner.scheduler.last_epoch == 8 and learner.optimizer.param_groups[0]["lr"] == 0.0


def test_compiled_layers_give_the_update_eager_ones_give(tiny_model_dir):
    from grpoflow.tasks.learner.learn import compile_layers

    grads, losses = [], []
    for compiled in (False, True):
        learner = make_learner(
            tiny_model_dir,
            lr=1e-3,
            total_steps=10,
            loss_type="grpo",
            compile=compiled,
            share_prompt=True,
            seed=0,
        )
        layers = [m for m in learner.model.modules() if type(m).__name__.endswith("DecoderLayer")]
        assert layers and all((m._compiled_call_impl is not None) == compiled for m in layers)
        assert learner.share_prompt is not compiled  # compiled layers run the padded forward
        learner.optimizer.step = lambda: None
        losses.append(learner.train_step(samples())["train/loss"])
        grads.append(torch.cat([p.grad.flatten() for p in learner.model.parameters()]))
    assert losses[0] == pytest.approx(losses[1], rel=1e-5)
    assert torch.allclose(grads[0], grads[1], rtol=1e-4, atol=1e-7)
    with pytest.raises(ValueError, match="learner.compile: Linear has no module named"):
        compile_layers(torch.nn.Linear(2, 2))

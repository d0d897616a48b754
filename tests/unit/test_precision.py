"""The precision recipe (docs/architecture.md, "Precision"): a bfloat16 learner computes in bf16 over
float32 master weights and float32 AdamW state, so its update is float32's within bf16's rounding of the
gradient, at RL's learning rates, where plain bf16 AdamW loses it. Runs on `--learner-device`."""

from __future__ import annotations

import pytest
import torch

from tests.support import make_learner
from tests.support import train_samples as samples

pytestmark = pytest.mark.unit

LR = 1e-6  # RL's range is 1e-6..1e-5: far below bf16's relative spacing of 2^-8 = 0.0039
# The recipe's update against float32's: ||recipe - float32|| / ||float32||. Adam's first update is
# lr * g / (|g| + eps) per element, so what differs is where bf16's rounding of the forward changes a
# gradient element's sign or brings it near eps; measured 0.1 on the tiny model (CPU). Plain bf16 AdamW
# measures ~1.0: its weights cannot hold the update at all.
TOLERANCE = 0.3


def flat(tensors) -> torch.Tensor:
    return torch.cat([t.detach().float().flatten() for t in tensors])


def update_error(update: torch.Tensor, reference: torch.Tensor) -> float:
    return float((update - reference).norm() / reference.norm())


@pytest.fixture
def float32_step(tiny_model_dir):
    """The reference: one float32 update at LR; (weights before, update, the learner after it)."""
    ref = make_learner(tiny_model_dir, lr=LR, total_steps=10, loss_type="dapo", seed=0)
    before = flat(ref.model.parameters())
    ref.train_step(samples())
    return before, flat(ref.model.parameters()) - before, ref


def test_bf16_recipe_update_matches_float32(tiny_model_dir, float32_step):
    before, reference, _ = float32_step
    mixed = make_learner(tiny_model_dir, lr=LR, total_steps=10, loss_type="dapo", seed=0, dtype="bfloat16")
    assert mixed.dtype == torch.bfloat16
    assert all(p.dtype == torch.float32 for p in mixed.model.parameters())  # master weights
    assert torch.equal(flat(mixed.model.parameters()), before)
    mixed.train_step(samples())
    moments = [s["exp_avg_sq"] for s in mixed.optimizer.state.values()]
    assert moments and all(m.dtype == torch.float32 for m in moments)
    update = flat(mixed.model.parameters()) - before
    assert update.abs().max() > 0
    assert update_error(update, reference) < TOLERANCE


def test_plain_bf16_adamw_fails_the_same_check(float32_step):
    # The same gradient (float32's, rounded to bf16) applied by torch's AdamW to bf16 weights: the
    # update falls below the weights' spacing and rounds away.
    _, reference, ref = float32_step
    params = [p.detach().to(torch.bfloat16).requires_grad_() for p in ref.model.parameters()]
    for p, r in zip(params, ref.model.parameters(), strict=True):
        p.grad = r.grad.to(torch.bfloat16)
    start = flat(params)
    torch.optim.AdamW(params, lr=LR, weight_decay=0.0).step()
    update = flat(params) - start
    assert update_error(update, reference) > 0.9 > TOLERANCE


def test_pushed_weights_are_the_compute_dtype_checkpoints_the_master_weights(tiny_model_dir, tmp_path):
    from safetensors.torch import load_file
    from transformers import AutoConfig

    learner = make_learner(tiny_model_dir, lr=1e-3, total_steps=10, seed=0, dtype="bfloat16")
    learner.train_step(samples())
    (tmp_path / "push").mkdir()
    learner.write_weights(tmp_path / "push")
    pushed = load_file(str(tmp_path / "push" / "model.safetensors"))
    master = dict(learner.model.named_parameters())
    assert pushed and all(t.dtype == torch.bfloat16 for t in pushed.values())
    for name, t in pushed.items():
        assert torch.equal(t, master[name].detach().to(torch.bfloat16).cpu()), name
    assert AutoConfig.from_pretrained(tmp_path / "push").dtype == torch.bfloat16
    learner.save(tmp_path / "ckpt")  # a checkpoint resumes from the float32 master weights, exactly
    saved = load_file(str(tmp_path / "ckpt" / "model" / "model.safetensors"))
    assert all(saved[n].dtype == torch.float32 and torch.equal(saved[n], p.detach().cpu())
               for n, p in master.items() if n in saved)  # fmt: skip


@pytest.mark.parametrize("lora", [False, True])
def test_a_bf16_step_casts_the_master_weights_once_per_update_for_the_same_gradients(
    tiny_model_dir, lora, monkeypatch
):
    """Three micro-batches of one sample, KL on (the reference's forwards run inside the update too): the
    bf16 copies of the trainable float32 weights are made once per update, not once per micro-batch, and
    the gradients are the same bits as with a copy per micro-batch (tasks/learner/speed.py)."""
    import contextlib

    from torch.utils._python_dispatch import TorchDispatchMode

    import grpoflow.tasks.learner.learn as learn_module

    class Casts(TorchDispatchMode):
        def __init__(self, watched):
            super().__init__()
            self.watched, self.n = watched, 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if func is torch.ops.aten._to_copy.default and kwargs.get("dtype") == torch.bfloat16:
                self.n += args[0].data_ptr() in self.watched
            return func(*args, **kwargs)

    def step(one_cast: bool):
        if not one_cast:
            monkeypatch.setattr(learn_module, "one_cast_per_update", lambda *a: contextlib.nullcontext())
        extra = {"lora": {"rank": 4, "alpha": 8}} if lora else {}
        learner = make_learner(tiny_model_dir, lr=1e-3, total_steps=10, seed=0, dtype="bfloat16",
                               micro_batch_size=1, beta=0.04, **extra)  # fmt: skip
        learner.optimizer.step = lambda: None
        casts = Casts({p.data_ptr() for p in learner.trainable})
        with casts:
            learner.train_step(samples())
        monkeypatch.undo()
        return casts.n, [p.grad.clone() for p in learner.trainable]

    once, grads = step(True)
    each, grads_each = step(False)
    weights = len(make_learner(tiny_model_dir, lr=1e-3, total_steps=10, dtype="bfloat16",
                               **({"lora": {"rank": 4, "alpha": 8}} if lora else {})).trainable)  # fmt: skip
    assert 0 < once <= weights and each == 3 * once  # three micro-batches
    assert all(torch.equal(a, b) for a, b in zip(grads, grads_each, strict=True))


def test_one_process_learner_steps_fused_adamw_with_foreach_numbers(float32_step):
    # One learner process takes torch's fused AdamW on the CPU as on a GPU (one pass over each tensor):
    # its update is the multi-tensor (foreach) AdamW's from the same clipped gradients, up to rounding.
    before, reference, ref = float32_step
    assert ref.optimizer.defaults["fused"] and not ref.optimizer.defaults["foreach"]
    grads = [p.grad.detach().clone() for p in ref.model.parameters()]
    params = [
        t.view_as(g).clone().requires_grad_()
        for t, g in zip(before.split([g.numel() for g in grads]), grads, strict=True)
    ]
    for p, g in zip(params, grads, strict=True):
        p.grad = g
    torch.optim.AdamW(params, lr=LR, weight_decay=ref.optimizer.defaults["weight_decay"], foreach=True).step()
    update = flat(params) - before
    assert update.abs().max() > 0
    assert update_error(update, reference) < 1e-5


def test_a_resumed_learner_keeps_its_own_adamw_kernel_and_takes_the_moments(tiny_model_dir, tmp_path):
    # A checkpoint's parameter groups name the kernel of the learner that wrote them (fused: one process).
    # A learner resuming it with the multi-tensor kernel (a sharded one's) keeps that kernel, and the moments.
    a = make_learner(tiny_model_dir, lr=LR, total_steps=10, seed=0)
    a.train_step(samples())
    a.save(tmp_path)
    b = make_learner(tiny_model_dir, lr=LR, total_steps=10, seed=0)
    for group in b.optimizer.param_groups:
        group["fused"], group["foreach"] = False, True
    b.load_trainer_state(tmp_path)
    assert all(g["fused"] is False and g["foreach"] is True for g in b.optimizer.param_groups)
    moments = [
        (s["exp_avg"], t["exp_avg"])
        for s, t in zip(a.optimizer.state.values(), b.optimizer.state.values(), strict=True)
    ]
    assert moments and all(torch.equal(x, y) for x, y in moments)

"""GRPO math with hand-derived numbers (derivations in comments)."""

from __future__ import annotations

import math
import statistics

import pytest
import torch

from tasks.config import AlgorithmConfig
from tasks.grpo import compute_loss, group_advantages

pytestmark = pytest.mark.unit

ALGORITHM_FIELDS = set(AlgorithmConfig.model_fields)


def loss_of(*tensors, **kw):
    """compute_loss with the algorithm fields among `kw` as its section (correction off unless given)."""
    algorithm = AlgorithmConfig(**{"correction": "none"} | {k: kw.pop(k) for k in set(kw) & ALGORITHM_FIELDS})
    return compute_loss(*tensors, algorithm, **kw)


LOSSES = ["grpo", "dr_grpo", "dapo", "gspo"]


def test_group_scale_leaves_invalid_out_of_mean_and_std():
    # valid rewards [1, 0, 1]: mean 2/3; unbiased std sqrt(((1/3)^2*2 + (2/3)^2) / 2) = sqrt(1/3)
    adv, mask, m = group_advantages([[1.0, 0.0, None, 1.0]], [[True, True, False, True]], eps=0.0)
    s = math.sqrt(1 / 3)
    assert adv[0] == pytest.approx([(1 / 3) / s, -(2 / 3) / s, 0.0, (1 / 3) / s])  # 0.577, -1.155, 0, 0.577
    assert mask == [[True, True, False, True]]
    assert m["groups_trained"] == 1 and m["valid_frac"] == 0.75


def test_a_failed_reward_is_not_a_zero():
    # If the invalid cell were scored 0, mean would be 0.5 and the advantages would change.
    adv_masked, _, _ = group_advantages([[1.0, None, 1.0, 0.0]], [[True, False, True, True]], eps=0.0)
    adv_zero, _, _ = group_advantages([[1.0, 0.0, 1.0, 0.0]], [[True, True, True, True]], eps=0.0)
    assert adv_masked[0][0] != pytest.approx(adv_zero[0][0])


def test_group_with_fewer_than_two_valid_trains_nothing():
    adv, mask, m = group_advantages([[1.0, None, None]], [[True, False, False]])
    assert adv == [[0.0, 0.0, 0.0]] and mask == [[False, False, False]]
    assert m["groups_too_few_valid"] == 1 and m["groups_trained"] == 0


def test_batch_scale():
    # all valid [1,0,3,1]: mean 1.25; squares .0625+1.5625+3.0625+.0625 = 4.75; /3 -> std 1.258306
    # group means 0.5 and 2.0 -> (1-.5)/1.258306 = 0.397360, (3-2)/1.258306 = 0.794719
    adv, _, _ = group_advantages(
        [[1.0, 0.0], [3.0, 1.0]], [[True, True], [True, True]], scale="batch", eps=0.0
    )
    assert adv == [
        pytest.approx([0.397360, -0.397360], abs=1e-6),
        pytest.approx([0.794719, -0.794719], abs=1e-6),
    ]


def test_no_scaling_and_zero_std_filter():
    adv, _, _ = group_advantages([[3.0, 1.0]], [[True, True]], scale="none")
    assert adv == [[1.0, -1.0]]  # r - mean(2)
    adv, mask, m = group_advantages([[1.0, 1.0], [1.0, 0.0]], [[True] * 2, [True] * 2], filter_zero_std=True)
    assert mask[0] == [False, False] and mask[1] == [True, True] and m["groups_zero_std"] == 1


def test_zero_std_is_judged_with_a_tolerance():
    # Equal rewards up to their last bit (0.1 + 0.2 vs 0.3): a real std of ~1e-17, which no stats
    # helper rounds to 0 and which `std == 0` would take for a signal.
    rewards = [0.1 + 0.2, 0.3, 0.3]
    assert 0 < statistics.stdev(rewards) < 1e-16
    adv, mask, m = group_advantages([rewards], [[True] * 3], filter_zero_std=True)
    assert mask == [[False] * 3] and m["groups_zero_std"] == 1 and m["groups_trained"] == 0
    adv, mask, m = group_advantages([rewards], [[True] * 3])  # not filtered: trained with advantage 0
    assert adv == [[0.0, 0.0, 0.0]] and mask == [[True] * 3]
    assert all(a == 0.0 for a in group_advantages([rewards], [[True] * 3], scale="none")[0][0])
    # a small but real spread (std 7.1e-4) is a signal, not noise
    adv, mask, m = group_advantages([[0.0, 1e-3]], [[True, True]], filter_zero_std=True)
    assert mask == [[True, True]] and m["groups_zero_std"] == 0 and adv[0][0] < 0 < adv[0][1]


def _two_seq():
    # seq A: 2 tokens, advantage 1; seq B: 1 token (+1 padding), advantage -0.5. Ratio 1 (on-policy).
    logp = torch.tensor([[-1.0, -2.0], [-0.5, 0.0]], requires_grad=True)
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    return logp, logp.detach().clone(), torch.tensor([1.0, -0.5]), mask


@pytest.mark.parametrize(
    "loss_type, expected, grads",
    [
        # per-token loss = -adv: A -> [-1, -1], B -> [0.5]
        ("grpo", (-1 + 0.5) / 2, [[-1 / 4, -1 / 4], [0.5 / 2, 0]]),  # mean of seq means = -0.25
        ("gspo", (-1 + 0.5) / 2, [[-1 / 4, -1 / 4], [0.5 / 2, 0]]),  # ratio 1: same as grpo
        ("dapo", (-2 + 0.5) / 3, [[-1 / 3, -1 / 3], [0.5 / 3, 0]]),  # token sum / 3 tokens = -0.5
        ("dr_grpo", (-2 + 0.5) / (2 * 4), [[-1 / 8, -1 / 8], [0.5 / 8, 0]]),  # / (2 seqs * L=4)
    ],
)
def test_loss_variants_hand_derived(loss_type, expected, grads):
    logp, behav, adv, mask = _two_seq()
    loss, m = loss_of(logp, behav, adv, mask, loss_type=loss_type, max_completion_length=4)
    assert loss.item() == pytest.approx(expected)
    loss.backward()
    # d(-ratio*adv)/dlogp = -adv at ratio 1, divided by the normaliser
    assert logp.grad.tolist() == [pytest.approx(g) for g in grads]
    assert m["ratio_mean"] == pytest.approx(1.0) and m["clip_frac_high"] == 0.0


def test_clipping():
    # ratio 1.5 > 1 + 0.2: with adv +1 the objective is clipped (constant 1.2, no gradient);
    # with adv -1 min(-1.5, -1.2) = -1.5 is not clipped, so the gradient flows.
    old = torch.tensor([[-1.0], [-1.0]])
    logp = (old + math.log(1.5)).clone().requires_grad_(True)
    mask = torch.ones(2, 1)
    loss, m = loss_of(logp, old, torch.tensor([1.0, -1.0]), mask, loss_type="dapo", old_logprobs=old)
    assert float(loss) == pytest.approx((-1.2 + 1.5) / 2)
    loss.backward()
    assert logp.grad[0, 0] == 0.0 and logp.grad[1, 0] == pytest.approx(1.5 / 2)  # d(1.5*e^x)/dx /2
    assert m["clip_frac_high"] == 0.5 and m["clip_frac_low"] == 0.0
    # epsilon_high widens only the upper side: 1.5 < 1 + 0.6, nothing clipped
    loss2, m2 = loss_of(
        logp, old, torch.tensor([1.0, -1.0]), mask, loss_type="dapo", old_logprobs=old, epsilon_high=0.6
    )
    assert float(loss2) == pytest.approx((-1.5 + 1.5) / 2) and m2["clip_frac_high"] == 0.0


@pytest.mark.parametrize(
    "correction, expected_loss, masked",
    [
        ("none", -1.0, 0.0),  # weight 1
        ("tis", -2.0, 0.0),  # w = 3 capped at 2
        ("icepop", 0.0, 1.0),  # w = 3 outside [1/2, 2]: token masked
        ("seq_mask", 0.0, 1.0),  # geometric-mean w = 3 outside the band: sequence masked
    ],
)
def test_off_policy_correction(correction, expected_loss, masked):
    logp = torch.tensor([[-1.0]], requires_grad=True)
    behaviour = torch.tensor([[-1.0 - math.log(3.0)]])  # the sampler gave this token 1/3 the prob
    loss, m = loss_of(
        logp,
        behaviour,
        torch.tensor([1.0]),
        torch.ones(1, 1),
        loss_type="dapo",
        correction=correction,
        correction_cap=2.0,
    )
    assert float(loss) == pytest.approx(expected_loss)
    assert m["is_masked_frac"] == masked
    assert m["mismatch_kl"] == pytest.approx(3 - math.log(3) - 1)  # k3 with log w = log 3


def test_kl_penalty_k3():
    # ref = logp + log 2 -> k3 = e^{log 2} - log 2 - 1 = 0.306853 per token; adv 0 leaves only KL
    logp = torch.tensor([[-1.0, -1.0]], requires_grad=True)
    ref = logp.detach() + math.log(2.0)
    loss, m = loss_of(
        logp,
        logp.detach(),
        torch.tensor([0.0]),
        torch.ones(1, 2),
        loss_type="dapo",
        ref_logprobs=ref,
        beta=0.1,
    )
    assert float(loss) == pytest.approx(0.1 * (2 - math.log(2) - 1))
    assert m["kl"] == pytest.approx(2 - math.log(2) - 1)


def _batch(seed: int, B: int = 6, T: int = 5, V: int = 7):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(B, T, V, generator=g, requires_grad=True)
    tokens = torch.randint(0, V, (B, T), generator=g)
    behav = torch.randn(B, T, generator=g) * 0.1 - 2.0
    adv = torch.randn(B, generator=g)
    mask = (torch.rand(B, T, generator=g) > 0.2).float()
    mask[:, 0] = 1.0
    return logits, tokens, behav, adv, mask


def _logp(logits, tokens):
    return torch.log_softmax(logits, -1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


@pytest.mark.parametrize("loss_type", LOSSES)
@pytest.mark.parametrize("correction", ["none", "tis", "icepop"])
def test_invalid_half_equals_batch_without_them(loss_type, correction):
    logits, tokens, behav, adv, mask = _batch(0)
    keep = torch.tensor([True, False, True, False, True, False])
    # Invalid samples: loss mask 0 and advantage 0, exactly as group_advantages marks them.
    m_full = mask * keep.unsqueeze(-1)
    adv_full = adv * keep
    kw = dict(loss_type=loss_type, correction=correction, max_completion_length=5)
    loss_full, _ = loss_of(_logp(logits, tokens), behav, adv_full, m_full, **kw)
    (g_full,) = torch.autograd.grad(loss_full, logits)

    sub = logits.detach()[keep].clone().requires_grad_(True)
    loss_sub, _ = loss_of(_logp(sub, tokens[keep]), behav[keep], adv[keep], mask[keep], **kw)
    (g_sub,) = torch.autograd.grad(loss_sub, sub)
    assert float(loss_full) == pytest.approx(float(loss_sub), rel=1e-6, abs=1e-8)
    assert torch.allclose(g_full[keep], g_sub, atol=1e-7)
    assert torch.count_nonzero(g_full[~keep]) == 0


@pytest.mark.parametrize("loss_type", LOSSES)
def test_micro_batches_add_up_to_the_full_batch(loss_type):
    logits, tokens, behav, adv, mask = _batch(1)
    kw = dict(loss_type=loss_type, max_completion_length=5)
    full, _ = loss_of(_logp(logits, tokens), behav, adv, mask, **kw)
    totals = dict(total_sequences=6, total_tokens=int(mask.sum()))
    parts = sum(
        loss_of(_logp(logits[s], tokens[s]), behav[s], adv[s], mask[s], **kw, **totals)[0]
        for s in (slice(0, 2), slice(2, 6))
    )
    assert float(parts) == pytest.approx(float(full), rel=1e-6)


# Sampler logprobs as they reach the learner: vLLM's -inf, the client's -1e4 stand-in for it, a
# nonsense +1e4, NaN, and an ordinary value. The learner's own logprobs hold extreme finite values.
GAPS = [-math.inf, -1e4, 1e4, math.nan, -1.5]


@pytest.mark.parametrize("loss_type", LOSSES)
@pytest.mark.parametrize("correction", ["none", "tis", "icepop", "seq_mask"])
@pytest.mark.parametrize("beta", [0.0, 0.1])
@pytest.mark.parametrize("behaviour_value", GAPS)
@pytest.mark.parametrize("stale", [False, True])
def test_any_sampler_gap_keeps_loss_gradients_and_metrics_finite(
    loss_type, correction, beta, behaviour_value, stale
):
    # Row 0: ordinary tokens; row 1: one extreme token; row 2: extreme learner values; row 3: padding
    # only. Padding (mask 0) holds garbage, including inf, as an unfilled buffer might.
    logp = torch.tensor(
        [
            [-1.0, -2.0, -0.5],
            [-1.0, -3.0, -math.inf],
            [-1e4, -1e-9, -80.0],
            [math.inf, -math.inf, 0.0],
        ],
        requires_grad=True,
    )
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0], [1.0, 1.0, 1.0], [0.0, 0.0, 0.0]])
    behaviour = torch.full((4, 3), -1.2)
    behaviour[1, 1] = behaviour_value
    behaviour[2, 0] = behaviour_value
    behaviour[3] = torch.tensor([-math.inf, math.nan, math.inf])
    # old_logprobs far from the learner (many optimizer steps per batch): huge ratios both ways
    old = torch.tensor([[-1.0, 60.0, -0.5], [-1.0, -3.0, 0.0], [-5.0, -1e4, -80.0], [0.0, 0.0, 0.0]])
    ref = torch.tensor([[-1.0, -2.0, -1e4], [-1e4, -3.0, 0.0], [-1.0, -1e4, -1.0], [0.0, 0.0, 0.0]])
    loss, metrics = loss_of(
        logp,
        behaviour,
        torch.tensor([1.0, -1.0, -2.0, 0.0]),
        mask,
        loss_type=loss_type,
        correction=correction,
        old_logprobs=old if stale else None,
        ref_logprobs=ref if beta else None,
        beta=beta,
        max_completion_length=3,
    )
    assert math.isfinite(float(loss)), float(loss)
    loss.backward()
    assert torch.isfinite(logp.grad).all(), logp.grad
    assert torch.count_nonzero(logp.grad * (1 - mask)) == 0  # padding never gets a gradient
    bad = {k: v for k, v in metrics.items() if not math.isfinite(v)}
    assert not bad, bad


@pytest.mark.parametrize("behaviour_value", [-math.inf, -1e4, math.nan])
def test_an_impossible_sampler_token_is_dropped_not_diluted(behaviour_value):
    # 100 ordinary on-policy tokens and one the sampler called impossible. icepop drops that token
    # (loss = the other 100 tokens' -adv, mean over 101); seq_mask drops the whole sequence even though
    # the mean of the clamped per-token gaps (20 / 101) would sit inside the band.
    logp = torch.full((1, 101), -1.0, requires_grad=True)
    behaviour = torch.full((1, 101), -1.0)
    behaviour[0, 50] = behaviour_value
    kw = dict(loss_type="dapo", correction_cap=2.0)
    loss, m = loss_of(logp, behaviour, torch.tensor([1.0]), torch.ones(1, 101), correction="icepop", **kw)
    assert float(loss) == pytest.approx(-100 / 101) and m["is_masked_frac"] == pytest.approx(1 / 101)
    loss, m = loss_of(logp, behaviour, torch.tensor([1.0]), torch.ones(1, 101), correction="seq_mask", **kw)
    assert float(loss) == 0.0 and m["is_masked_frac"] == 1.0

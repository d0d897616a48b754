"""GRPO math with hand-derived numbers (derivations in comments)."""

from __future__ import annotations

import math
import statistics

import pytest
import torch

from grpoflow.tasks.config.algorithm import AlgorithmConfig
from grpoflow.tasks.learner.grpo import compute_loss, group_advantages

pytestmark = pytest.mark.unit

ALGORITHM_FIELDS = set(AlgorithmConfig.model_fields)


def loss_of(*tensors, **kw):
    """compute_loss with the algorithm fields among `kw` as its section (correction off unless given)."""
    algorithm = AlgorithmConfig(**{"correction": "none"} | {k: kw.pop(k) for k in set(kw) & ALGORITHM_FIELDS})
    return compute_loss(*tensors, algorithm, **kw)


LOSSES = ["grpo", "dr_grpo", "dapo", "gspo", "cispo"]


@pytest.fixture(autouse=True)
def _on_the_learner_device(learner_device):
    """The loss runs where the learner does: `pytest --learner-device cuda` builds these tensors there."""
    with torch.device(learner_device):
        yield


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
    assert float(logp.grad[0, 0]) == 0.0 and float(logp.grad[1, 0]) == pytest.approx(
        1.5 / 2
    )  # d(1.5*e^x)/dx /2
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
    """Random inputs drawn on the CPU (the same numbers whatever the device), put where the loss runs."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(B, T, V, generator=g, device="cpu")
    tokens = torch.randint(0, V, (B, T), generator=g, device="cpu")
    behav = torch.randn(B, T, generator=g, device="cpu") * 0.1 - 2.0
    adv = torch.randn(B, generator=g, device="cpu")
    mask = (torch.rand(B, T, generator=g, device="cpu") > 0.2).float()
    mask[:, 0] = 1.0
    dev = torch.get_default_device()
    logits = logits.to(dev).requires_grad_(True)
    return logits, tokens.to(dev), behav.to(dev), adv.to(dev), mask.to(dev)


def _logp(logits, tokens):
    return torch.log_softmax(logits, -1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


@pytest.mark.parametrize("loss_type", LOSSES)
@pytest.mark.parametrize("correction", ["none", "tis", "icepop", "seq_mask", "seq_tis"])
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
@pytest.mark.parametrize("correction", ["none", "tis", "icepop", "seq_mask", "seq_tis"])
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


# --- leave-one-out baseline (RLOO) ------------------------------------------------------------------


def test_leave_one_out_baseline_hand_derived():
    # valid [1, 0, 1] (the 4th is invalid): baselines (0+1)/2, (1+1)/2, (1+0)/2 -> advantages .5, -1, .5
    rewards, valid = [[1.0, 0.0, 1.0, None]], [[True, True, True, False]]
    adv, mask, _ = group_advantages(rewards, valid, baseline="leave_one_out", scale="none")
    assert adv == [[0.5, -1.0, 0.5, 0.0]] and mask == [[True, True, True, False]]
    # = G/(G-1) x the group-mean advantage, so `group` scaling divides the same std (sqrt(1/3))
    adv_g, _, _ = group_advantages(rewards, valid, baseline="leave_one_out", eps=0.0)
    adv_m, _, _ = group_advantages(rewards, valid, eps=0.0)
    assert adv_g[0][:3] == pytest.approx(
        [0.5 / math.sqrt(1 / 3), -1 / math.sqrt(1 / 3), 0.5 / math.sqrt(1 / 3)]
    )
    assert adv_g[0][:3] == pytest.approx([1.5 * a for a in adv_m[0][:3]])
    # fewer than 2 valid: nothing trains; equal rewards: advantages exactly 0
    adv, mask, _ = group_advantages([[1.0, None]], [[True, False]], baseline="leave_one_out")
    assert adv == [[0.0, 0.0]] and mask == [[False, False]]
    adv, _, _ = group_advantages([[0.1 + 0.2, 0.3]], [[True, True]], baseline="leave_one_out", scale="none")
    assert adv == [[0.0, 0.0]]


def test_leave_one_out_keeps_imputed_values_out_of_other_baselines():
    # Required R and optional O (weight 1 each). B's O failed and was imputed with the mean of A's and
    # C's O values (0.5). Totals: A 1+1 = 2, B 0+0.5 = 0.5, C 1+0 = 1.
    parts = [[[(1.0, 1.0), (1.0, 1.0)], [(1.0, 0.0), (1.0, None)], [(1.0, 1.0), (1.0, 0.0)]]]
    rewards, valid = [[2.0, 0.5, 1.0]], [[True] * 3]
    adv, _, _ = group_advantages(rewards, valid, baseline="leave_one_out", scale="none", parts=parts)
    # A: R baseline (0+1)/2, O baseline C's own 0 (B has none of its own)   -> 2 - 0.5 = 1.5
    # B: R baseline (1+1)/2, O baseline (1+0)/2                              -> 0.5 - 1.5 = -1.0
    # C: R baseline (1+0)/2, O baseline A's own 1                            -> 1 - 1.5 = -0.5
    assert adv == [pytest.approx([1.5, -1.0, -0.5])]
    # On the totals, B's 0.5 (made from A's and C's own O) would enter A's and C's baselines:
    totals, _, _ = group_advantages(rewards, valid, baseline="leave_one_out", scale="none")
    assert totals == [pytest.approx([1.25, -1.0, -0.25])]


# --- several updates per batch: the ratio, the clip, GSPO and CISPO ---------------------------------


def test_gspo_and_grpo_differ_once_the_ratio_is_not_1():
    # One sequence, adv +1, token ratios 1.5 and 0.9 against pi_old (epsilon 0.2).
    # grpo: token 1 is clipped (1.5 > 1.2, adv > 0: no gradient), token 2 is not: loss -(1.2 + 0.9)/2,
    #   gradient [0, -0.9/2].
    # gspo: sequence ratio sqrt(1.5 * 0.9) = 1.161895 < 1.2, not clipped: loss -1.161895, each token's
    #   gradient -1.161895/2 (d s / d logp_t = s / T, summed over T tokens' -s / T each).
    old = torch.tensor([[-1.0, -2.0]])
    s = math.sqrt(1.5 * 0.9)
    out = {}
    for loss_type in ("grpo", "gspo"):
        logp = (old + torch.log(torch.tensor([[1.5, 0.9]]))).requires_grad_(True)
        loss, m = loss_of(
            logp, old, torch.tensor([1.0]), torch.ones(1, 2), loss_type=loss_type, old_logprobs=old
        )
        loss.backward()
        out[loss_type] = (float(loss), logp.grad[0].tolist(), m)
    assert out["grpo"][0] == pytest.approx(-(1.2 + 0.9) / 2)
    assert out["grpo"][1] == pytest.approx([0.0, -0.9 / 2])
    assert out["grpo"][2]["clip_frac_high"] == 0.5
    assert out["gspo"][0] == pytest.approx(-s)
    assert out["gspo"][1] == pytest.approx([-s / 2, -s / 2])
    assert out["gspo"][2]["clip_frac_high"] == 0.0 and out["gspo"][2]["ratio_mean"] == pytest.approx(s)
    # policy_kl: the k3 estimate of KL(pi_old || pi), mean over tokens of r - log r - 1
    k3 = [r - math.log(r) - 1 for r in (1.5, 0.9)]
    assert out["grpo"][2]["policy_kl"] == pytest.approx(sum(k3) / 2)


def test_cispo_clips_the_weight_but_keeps_every_gradient():
    # Two tokens, ratio 1.5 each against pi_old; adv +1 and -1; epsilon 0.2: weight min(1.5, 1.2) = 1.2,
    # detached. loss = token sum of -1.2 * adv * logp / 2 tokens = (-1.2*(a) + 1.2*(a - 1)) / 2 = -0.6
    # with logp = (a, a - 1). Gradient -1.2 * adv / 2 per token: the adv +1 token, which the PPO clip
    # silences, still moves (by -0.6).
    old = torch.tensor([[-1.0], [-2.0]])
    logp = (old + math.log(1.5)).requires_grad_(True)
    adv = torch.tensor([1.0, -1.0])
    loss, m = loss_of(logp, old, adv, torch.ones(2, 1), loss_type="cispo", old_logprobs=old)
    assert float(loss) == pytest.approx(-0.6)
    loss.backward()
    assert logp.grad[:, 0].tolist() == pytest.approx([-0.6, 0.6])
    assert m["clip_frac_high"] == 1.0 and m["clip_frac_low"] == 0.0  # the weight is bounded at either sign
    ppo = logp.detach().clone().requires_grad_(True)
    loss_of(ppo, old, adv, torch.ones(2, 1), loss_type="dapo", old_logprobs=old)[0].backward()
    assert ppo.grad[0, 0] == 0.0
    # MiniMax-M1's setting: no lower bound (epsilon 1: floor 0): a ratio of 0.1 weighs 0.1, not 0.8
    low = (old + math.log(0.1)).requires_grad_(True)
    loss_of(low, old, torch.tensor([1.0, 1.0]), torch.ones(2, 1), loss_type="cispo", old_logprobs=old,
            epsilon=1.0, epsilon_high=3.0)[0].backward()  # fmt: skip
    assert low.grad[:, 0].tolist() == pytest.approx([-0.1 / 2, -0.1 / 2])


@pytest.mark.parametrize("loss_type", ["dapo", "grpo", "gspo", "dr_grpo"])
def test_cispo_at_ratio_1_is_the_plain_policy_gradient(loss_type):
    # With one update per batch (ratio 1, no clip) every loss's gradient is -adv * grad log p over its
    # normaliser; cispo normalises like dapo.
    logits, tokens, behav, adv, mask = _batch(2)
    grads = {}
    for lt in (loss_type, "cispo"):
        lp = _logp(logits, tokens)
        loss, _ = loss_of(lp, behav, adv, mask, loss_type=lt, max_completion_length=5)
        (grads[lt],) = torch.autograd.grad(loss, logits)
    if loss_type == "dapo":
        assert torch.allclose(grads["dapo"], grads["cispo"], atol=1e-7)
    else:
        assert not torch.allclose(grads[loss_type], grads["cispo"], atol=1e-7)  # the normalisers differ


# --- sequence-level corrections -------------------------------------------------------------------


def test_seq_tis_truncates_a_sequence_weight():
    # Sequence 1: token weights pi_old/mu 4 and 1 -> geometric mean 2, capped at 1.5 for both tokens.
    # Sequence 2: weights 1.2 and 1.2 -> 1.2, under the cap. dapo, adv 1, ratio 1:
    # loss = -(1.5 * 2 + 1.2 * 2) / 4 = -1.35.
    logp = torch.tensor([[-1.0, -1.0], [-1.0, -1.0]], requires_grad=True)
    behaviour = logp.detach() - torch.log(torch.tensor([[4.0, 1.0], [1.2, 1.2]]))
    loss, m = loss_of(logp, behaviour, torch.tensor([1.0, 1.0]), torch.ones(2, 2), loss_type="dapo",
                      correction="seq_tis", correction_cap=1.5)  # fmt: skip
    assert float(loss) == pytest.approx(-1.35)
    assert m["is_capped_frac"] == 0.5 and m["is_weight_mean"] == pytest.approx((1.5 * 2 + 1.2 * 2) / 4)
    assert m["is_masked_frac"] == 0.0 and m["is_masked_seq_frac"] == 0.0
    # token-level tis on the same gaps caps only the weight-4 token: -(1.5 + 1 + 1.2 + 1.2) / 4
    loss, m = loss_of(logp, behaviour, torch.tensor([1.0, 1.0]), torch.ones(2, 2), loss_type="dapo",
                      correction="tis", correction_cap=1.5)  # fmt: skip
    assert float(loss) == pytest.approx(-(1.5 + 1 + 1.2 + 1.2) / 4) and m["is_capped_frac"] == 0.25


@pytest.mark.parametrize(
    "weights, low, high, kept",
    [
        ([2.5, 0.6], None, None, [False, True]),  # symmetric band [1/2, 2] from correction_cap 2
        ([2.5, 0.6], 0.7, 3.0, [True, False]),  # the band [0.7, 3]: 2.5 stays, 0.6 goes
        ([2.5, 1e-3], 0.0, 3.0, [True, True]),  # no lower bound
    ],
)
def test_seq_mask_keeps_the_band_between_its_own_bounds(weights, low, high, kept):
    # Two 2-token sequences whose token weights pi_old/mu are both `weights[i]`: the geometric mean is
    # weights[i]. Kept sequences train (loss -adv per token, dapo); dropped ones contribute 0.
    logp = torch.full((2, 2), -1.0, requires_grad=True)
    behaviour = logp.detach() - torch.log(torch.tensor(weights)).unsqueeze(-1)
    loss, m = loss_of(logp, behaviour, torch.tensor([1.0, 1.0]), torch.ones(2, 2), loss_type="dapo",
                      correction="seq_mask", correction_low=low, correction_high=high)  # fmt: skip
    assert float(loss) == pytest.approx(-sum(kept) * 2 / 4)
    assert m["is_masked_seq_frac"] == (2 - sum(kept)) / 2
    # icepop applies the same band per token
    loss, _ = loss_of(logp, behaviour, torch.tensor([1.0, 1.0]), torch.ones(2, 2), loss_type="dapo",
                      correction="icepop", correction_low=low, correction_high=high)  # fmt: skip
    assert float(loss) == pytest.approx(-sum(w * 2 for w, k in zip(weights, kept, strict=True) if k) / 4)

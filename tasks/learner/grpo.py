"""GRPO math: masked group advantages and the policy-gradient losses. Pure: torch, lists and the
`algorithm` config section; no I/O.

Shapes: B sequences, T completion tokens (right-padded). `mask` [B, T] is completion_mask x sample
loss mask, so tool results, padding and invalid samples never contribute.
"""

from __future__ import annotations

import math
import statistics
from typing import TYPE_CHECKING

import torch

from grpoflow.tasks.config.choices import Baseline, LossType, Scale
from grpoflow.tasks.group_signal import is_flat, reward_std

if TYPE_CHECKING:
    from grpoflow.tasks.config.algorithm import AlgorithmConfig

# One reward function's share of a completion's reward: (weight, its own valid value or None when the
# cell is invalid, whether imputed or not).
Part = tuple[float, float | None]


def group_advantages(
    rewards: list[list[float | None]],
    valid: list[list[bool]],
    *,
    scale: Scale = "group",
    baseline: Baseline = "group_mean",
    parts: list[list[list[Part]] | None] | None = None,
    filter_zero_std: bool = False,
    eps: float = 1e-4,
) -> tuple[list[list[float]], list[list[bool]], dict[str, float]]:
    """Per-completion advantages and loss masks for a batch of groups.

    Invalid completions are left out of the baselines and stds, get advantage 0 and mask False; a
    group with fewer than 2 valid completions trains nothing. The baseline b is the group's mean valid
    reward (`group_mean`) or the mean of the other valid rewards (`leave_one_out`, RLOO). `group`:
    (r - b) / (std_g + eps); `batch`: (r - b) / (std over all valid rewards of the batch + eps);
    `none`: r - b. A group whose std is within ZERO_STD_RTOL (tasks/group_signal.py) of its magnitude
    has zero std: advantages exactly 0, and with `filter_zero_std` it trains nothing.

    `parts` (per group, None or per completion, per reward function: (weight, own valid value or None)) makes
    leave_one_out leave each function out separately, so a value imputed from the group's other samples
    never enters their baselines: function j's baseline for sample k is the mean of the others' own
    values of j (none: k's own value, or 0 when k has none either, which is what its reward holds).
    """
    groups_valid = [
        [r for r, v in zip(rs, vs, strict=True) if v and r is not None]
        for rs, vs in zip(rewards, valid, strict=True)
    ]
    all_valid = [r for g in groups_valid for r in g]
    batch_std = reward_std(all_valid) if len(all_valid) > 1 else 0.0
    advs, masks = [], []
    too_few = zero_std = trained = 0
    for gi, (rs, vs, good) in enumerate(zip(rewards, valid, groups_valid, strict=True)):
        use = len(good) >= 2
        too_few += not use
        std = reward_std(good) if use else 0.0
        flat = use and is_flat(good, std)
        if flat and filter_zero_std:
            use = False
            zero_std += 1
        ok = [use and v and r is not None for r, v in zip(rs, vs, strict=True)]
        base = _baselines(rs, ok, baseline, parts[gi] if parts is not None else None) if use else ok
        denom = {"group": std + eps, "batch": batch_std + eps, "none": 1.0}[scale]
        advs.append(
            [(r - b) / denom if k and not flat else 0.0 for r, k, b in zip(rs, ok, base, strict=True)]
        )
        masks.append(ok)
        trained += use
    n = sum(len(v) for v in valid)
    metrics = {
        "groups": float(len(rewards)),
        "groups_trained": float(trained),
        "groups_too_few_valid": float(too_few),
        "groups_zero_std": float(zero_std),
        "valid_frac": (sum(sum(v) for v in valid) / n) if n else 0.0,
        "batch_std": batch_std,
    }
    return advs, masks, metrics


def _baselines(rs: list, ok: list[bool], baseline: Baseline, parts: list[list[Part]] | None) -> list[float]:
    """Each completion's baseline within one group (0 where `ok` is False); at least 2 are ok."""
    good = [r for r, k in zip(rs, ok, strict=True) if k]
    if baseline == "group_mean":
        mean = statistics.fmean(good)
        return [mean if k else 0.0 for k in ok]
    if baseline != "leave_one_out":
        raise ValueError(f"unknown baseline {baseline!r}")
    if parts is None:
        total = math.fsum(good)
        return [(total - r) / (len(good) - 1) if k else 0.0 for r, k in zip(rs, ok, strict=True)]
    out = []
    for k, (mine, is_ok) in enumerate(zip(parts, ok, strict=True)):
        b = 0.0
        for j, (w, own) in enumerate(mine):
            others = [p[j][1] for i, p in enumerate(parts) if ok[i] and i != k and p[j][1] is not None]
            b += w * (statistics.fmean(others) if others else (own or 0.0))
        out.append(b if is_ok else 0.0)
    return out


# Bound on every log-ratio that reaches exp() (importance weight, policy ratio, KL). e^20 ~ 4.9e8 lies
# far outside any clip range or correction cap, so decisions on ordinary values are unchanged, while
# float32 (max ~e^88) can never overflow into inf, and inf can never meet a 0 mask and become NaN.
LOG_RATIO_BOUND = 20.0


def _bounded(x: torch.Tensor, on: torch.Tensor, *, nan: float = 0.0) -> torch.Tensor:
    """`x` on the `on` tokens (0 elsewhere), NaN replaced by `nan`, clamped to +-LOG_RATIO_BOUND."""
    # torch.where, not `* mask`: padding may hold inf, and inf * 0 is NaN, in the backward pass too.
    # Past the bound the clamp passes no gradient: a 5e8-sized ratio is an accident, not a signal.
    x = torch.where(on, x, torch.zeros_like(x))
    return x.nan_to_num(nan=nan).clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)


def _masked_mean(x: torch.Tensor, mask: torch.Tensor) -> float:
    n = mask.sum()
    return float(torch.where(mask > 0, x, torch.zeros_like(x)).sum() / n) if n > 0 else 0.0


def _k3(d: torch.Tensor, on: torch.Tensor) -> torch.Tensor:
    """k3 estimator e^d - d - 1 of a KL from the log-difference d, finite for any d."""
    d = _bounded(d, on)
    return torch.exp(d) - d - 1


def correction_band(a: AlgorithmConfig) -> tuple[float, float]:
    """[low, high] of the ratios icepop and seq_mask keep: [1/correction_cap, correction_cap] unless
    `correction_low` / `correction_high` say otherwise."""
    low = 1.0 / a.correction_cap if a.correction_low is None else a.correction_low
    high = a.correction_cap if a.correction_high is None else a.correction_high
    return low, high


def _off_policy_weights(
    gap: torch.Tensor, on: torch.Tensor, seq_tokens: torch.Tensor, a: AlgorithmConfig
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(bounded log w, per-token weight, dropped, capped indicators) for the gap log pi_old - log mu.

    The gap [B, T] may hold +-inf (vLLM's -inf logprob) or its -1e4 stand-in. An unknown gap (NaN,
    e.g. -inf - -inf) counts as the largest: icepop and seq_mask drop it, tis and seq_tis cap it.
    """
    log_w = _bounded(gap, on, nan=LOG_RATIO_BOUND)
    w = torch.exp(log_w)
    weight, dropped, capped = torch.ones_like(w), torch.zeros_like(on), torch.zeros_like(on)
    low, high = correction_band(a)
    if a.correction == "tis":
        weight, capped = w.clamp(max=a.correction_cap), (w > a.correction_cap) & on
    elif a.correction == "icepop":
        keep = (w >= low) & (w <= high)
        weight, dropped = torch.where(keep, w, torch.zeros_like(w)), ~keep & on
    elif a.correction == "seq_mask":
        # The unbounded gaps decide: one token the sampler called impossible must still drop a long
        # sequence, which a mean of clamped values would dilute. A NaN mean compares False: dropped.
        seq = torch.where(on, gap, torch.zeros_like(gap)).sum(-1) / seq_tokens.clamp(min=1)
        floor = math.log(low) if low > 0 else -math.inf
        keep = ((seq >= floor) & (seq <= math.log(high))).unsqueeze(-1)
        weight, dropped = keep.to(w.dtype).expand_as(w), ~keep & on
    elif a.correction == "seq_tis":
        # Truncation caps whatever the mean holds, so the bounded gaps serve (NaN counted as the largest).
        seq_w = torch.exp(log_w.sum(-1) / seq_tokens.clamp(min=1)).unsqueeze(-1)  # [B, 1]
        weight, capped = seq_w.clamp(max=a.correction_cap).expand_as(w), (seq_w > a.correction_cap) & on
    return log_w, weight, dropped, capped


def _normalise(per_token, seq_tokens, seq_on, loss_type: LossType, n_seq: int, n_tok: int, L: int):
    if loss_type in ("grpo", "gspo"):
        return ((per_token.sum(-1) / seq_tokens.clamp(min=1)) * seq_on).sum() / max(n_seq, 1)
    if loss_type in ("dapo", "cispo"):
        return per_token.sum() / max(n_tok, 1)
    if loss_type == "dr_grpo":
        return per_token.sum() / (max(n_seq, 1) * L)
    raise ValueError(f"unknown loss_type {loss_type!r}")


def compute_loss(
    logprobs: torch.Tensor,  # [B, T] current policy, requires grad
    behaviour_logprobs: torch.Tensor,  # [B, T] from vLLM (the sampler)
    advantages: torch.Tensor,  # [B]
    mask: torch.Tensor,  # [B, T] 1 = token counts in the loss
    algorithm: AlgorithmConfig,
    *,
    old_logprobs: torch.Tensor | None = None,  # [B, T] policy at the batch's start; None: this policy
    ref_logprobs: torch.Tensor | None = None,  # [B, T]
    max_completion_length: int | None = None,
    total_sequences: int | None = None,
    total_tokens: int | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Clipped policy-gradient loss with masks, normalisation variants and off-policy correction.

    `algorithm` gives the loss type, clip range, KL coefficient and correction. Normalisation: grpo =
    mean over sequences of per-sequence token means; dapo and cispo = token sum / tokens; dr_grpo =
    token sum / (sequences * max_completion_length); gspo = mean over sequences of the clipped
    sequence-level objective. The ratio pi / pi_old is 1 unless `old_logprobs` (the policy before this
    batch's first update) is given. The off-policy correction compares pi_old with the sampler.
    `total_sequences`/`total_tokens` replace the local counts so micro-batch losses add up to the
    full-batch loss under gradient accumulation. Every log-ratio is bounded by LOG_RATIO_BOUND, so
    loss, gradients and metrics stay finite for any sampler gap.
    """
    a = algorithm
    on = mask > 0
    mask = mask.to(logprobs.dtype)
    seq_tokens = mask.sum(-1)  # [B]
    seq_on = (seq_tokens > 0).to(logprobs.dtype)
    n_seq = total_sequences if total_sequences is not None else int(seq_on.sum())
    n_tok = total_tokens if total_tokens is not None else int(mask.sum())
    eps_hi = a.epsilon if a.epsilon_high is None else a.epsilon_high
    old = logprobs.detach() if old_logprobs is None else old_logprobs
    adv = advantages.to(logprobs.dtype).unsqueeze(-1)  # [B, 1]

    # Learner-vs-sampler mismatch (includes staleness): w = pi_old / mu, per token, no gradient.
    gap = (old - behaviour_logprobs).detach()
    log_w, weight, dropped, capped = _off_policy_weights(gap, on, seq_tokens, a)

    ratio = _policy_ratio(logprobs, old, on, seq_tokens, sequence_level=a.loss_type == "gspo")
    clipped = ratio.clamp(1 - a.epsilon, 1 + eps_hi)
    if a.loss_type == "cispo":
        # The clipped ratio is a coefficient without gradient; the gradient is the log-probability's.
        per_token = -clipped.detach() * adv * torch.where(on, logprobs, torch.zeros_like(logprobs)) * weight
    else:
        per_token = -torch.minimum(ratio * adv, clipped * adv) * weight
    if ref_logprobs is not None and a.beta > 0:
        per_token = per_token + a.beta * _k3(ref_logprobs - logprobs, on)  # KL(pi || ref)
    per_token = torch.where(on, per_token, torch.zeros_like(per_token))
    L = max_completion_length or logprobs.shape[-1]
    loss = _normalise(per_token, seq_tokens, seq_on, a.loss_type, n_seq, n_tok, L)

    metrics = _loss_metrics(loss, ratio, adv, mask, a, eps_hi)
    metrics |= _correction_metrics(log_w, weight, dropped, capped, mask, seq_tokens)
    # k3 estimate of KL(pi_old || pi) on the batch's tokens: how far the updates have moved the policy.
    metrics["policy_kl"] = _masked_mean(_k3(logprobs.detach() - old, on), mask)
    metrics["entropy_proxy"] = -_masked_mean(logprobs.detach(), mask)
    if ref_logprobs is not None:
        metrics["kl"] = _masked_mean(_k3(ref_logprobs - logprobs.detach(), on), mask)
    return loss, metrics


def _policy_ratio(logprobs, old, on, seq_tokens, *, sequence_level: bool) -> torch.Tensor:
    """pi / pi_old per token; GSPO's sequence ratio (geometric mean of the token ratios) as a per-token
    tensor whose value is the sequence's but whose gradient flows per token."""
    log_ratio = _bounded(logprobs - old, on)
    if sequence_level:
        seq_log_ratio = log_ratio.sum(-1) / seq_tokens.clamp(min=1)  # [B]
        log_ratio = _bounded(seq_log_ratio.detach().unsqueeze(-1) + logprobs - logprobs.detach(), on)
    return torch.exp(log_ratio)


@torch.no_grad()
def _loss_metrics(loss, ratio, adv, mask, a: AlgorithmConfig, eps_hi: float) -> dict[str, float]:
    """The loss, the ratio's spread and how often the clip acted: for the PPO-style losses where it
    removed a token's gradient (ratio past the bound on the side the advantage pushes), for cispo
    where it bounded the token's weight (either sign)."""
    r, on = ratio.detach(), mask > 0
    high, low = r > 1 + eps_hi, r < 1 - a.epsilon
    if a.loss_type != "cispo":
        high, low = high & (adv > 0), low & (adv < 0)
    return {
        "loss": float(loss.detach()),
        "clip_frac_low": _masked_mean(low.to(mask.dtype), mask),
        "clip_frac_high": _masked_mean(high.to(mask.dtype), mask),
        "ratio_mean": _masked_mean(r, mask),
        "ratio_min": float(r[on].min()) if on.any() else 1.0,
        "ratio_max": float(r[on].max()) if on.any() else 1.0,
    }


@torch.no_grad()
def _correction_metrics(log_w, weight, dropped, capped, mask, seq_tokens) -> dict[str, float]:
    seqs = seq_tokens > 0
    seq_dropped = (dropped.to(mask.dtype).sum(-1) == seq_tokens) & seqs
    return {
        # k3 estimate of KL(mu || pi_old) from the sampler's tokens: the mismatch to correct.
        "mismatch_kl": _masked_mean(torch.exp(log_w) - log_w - 1, mask),
        "is_weight_mean": _masked_mean(weight, mask),
        "is_masked_frac": _masked_mean(dropped.to(mask.dtype), mask),
        "is_masked_seq_frac": float(seq_dropped.sum() / seqs.sum()) if seqs.any() else 0.0,
        "is_capped_frac": _masked_mean(capped.to(mask.dtype), mask),
    }

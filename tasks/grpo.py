"""GRPO math: masked group advantages and the policy-gradient losses. Pure: torch and lists only.

Shapes: B sequences, T completion tokens (right-padded). `mask` [B, T] is completion_mask x sample
loss mask, so tool results, padding and invalid samples never contribute.
"""

from __future__ import annotations

import math
from typing import Literal

import torch

Scale = Literal["group", "batch", "none"]
LossType = Literal["grpo", "dr_grpo", "dapo", "gspo"]
Correction = Literal["none", "tis", "icepop", "seq_mask"]


def _std(xs: list[float]) -> float:
    # Unbiased (n-1) std, like torch.std and TRL: with G=2 the population std halves the signal's scale.
    m = sum(xs) / len(xs)
    return math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1)) if len(xs) > 1 else 0.0


def group_advantages(
    rewards: list[list[float | None]],
    valid: list[list[bool]],
    *,
    scale: Scale = "group",
    filter_zero_std: bool = False,
    eps: float = 1e-4,
) -> tuple[list[list[float]], list[list[bool]], dict[str, float]]:
    """Per-completion advantages and loss masks for a batch of groups.

    Invalid completions are left out of the mean and std, get advantage 0 and mask False; a group
    with fewer than 2 valid completions trains nothing. `group`: (r - mean_g) / (std_g + eps);
    `batch`: (r - mean_g) / (std over all valid rewards of the batch + eps); `none`: r - mean_g.
    """
    groups_valid = [
        [r for r, v in zip(rs, vs, strict=True) if v and r is not None]
        for rs, vs in zip(rewards, valid, strict=True)
    ]
    all_valid = [r for g in groups_valid for r in g]
    batch_std = _std(all_valid) if len(all_valid) > 1 else 0.0
    advs, masks = [], []
    too_few = zero_std = trained = 0
    for rs, vs, good in zip(rewards, valid, groups_valid, strict=True):
        use = len(good) >= 2
        too_few += not use
        mean = sum(good) / len(good) if good else 0.0
        std = _std(good) if use else 0.0
        if use and filter_zero_std and std == 0.0:
            use = False
            zero_std += 1
        denom = {"group": std + eps, "batch": batch_std + eps, "none": 1.0}[scale]
        row_adv, row_mask = [], []
        for r, v in zip(rs, vs, strict=True):
            ok = use and v and r is not None
            row_adv.append((r - mean) / denom if ok else 0.0)
            row_mask.append(ok)
        trained += use
        advs.append(row_adv)
        masks.append(row_mask)
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


def _masked_mean(x: torch.Tensor, mask: torch.Tensor) -> float:
    n = mask.sum()
    return float((x * mask).sum() / n) if n > 0 else 0.0


def compute_loss(
    logprobs: torch.Tensor,  # [B, T] current policy, requires grad
    behaviour_logprobs: torch.Tensor,  # [B, T] from vLLM (the sampler)
    advantages: torch.Tensor,  # [B]
    mask: torch.Tensor,  # [B, T] 1 = token counts in the loss
    *,
    loss_type: LossType = "grpo",
    epsilon: float = 0.2,
    epsilon_high: float | None = None,
    old_logprobs: torch.Tensor | None = None,  # [B, T]; None: one optimizer step per batch
    ref_logprobs: torch.Tensor | None = None,  # [B, T]
    beta: float = 0.0,
    correction: Correction = "none",
    correction_cap: float = 2.0,
    max_completion_length: int | None = None,
    total_sequences: int | None = None,
    total_tokens: int | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Clipped policy-gradient loss with masks, normalisation variants and off-policy correction.

    Normalisation: grpo = mean over sequences of per-sequence token means; dapo = token sum / tokens;
    dr_grpo = token sum / (sequences * max_completion_length); gspo = mean over sequences of the
    clipped sequence-level objective. `total_sequences`/`total_tokens` replace the local counts so
    micro-batch losses add up to the full-batch loss under gradient accumulation.
    """
    mask = mask.to(logprobs.dtype)
    seq_tokens = mask.sum(-1)  # [B]
    seq_on = (seq_tokens > 0).to(logprobs.dtype)
    n_seq = total_sequences if total_sequences is not None else int(seq_on.sum())
    n_tok = total_tokens if total_tokens is not None else int(mask.sum())
    eps_hi = epsilon if epsilon_high is None else epsilon_high
    old = logprobs.detach() if old_logprobs is None else old_logprobs
    adv = advantages.to(logprobs.dtype).unsqueeze(-1)  # [B, 1]

    # Learner-vs-sampler mismatch (includes staleness): w = pi_old / mu, per token, no gradient.
    log_w = (old - behaviour_logprobs).detach() * mask
    w = torch.exp(log_w)
    weight = torch.ones_like(w)
    is_masked = torch.zeros_like(w)
    if correction == "tis":
        weight = w.clamp(max=correction_cap)
    elif correction == "icepop":
        keep = ((w >= 1.0 / correction_cap) & (w <= correction_cap)).to(w.dtype)
        weight, is_masked = w * keep, (1 - keep) * mask
    elif correction == "seq_mask":
        seq_log_w = log_w.sum(-1) / seq_tokens.clamp(min=1)
        keep = (seq_log_w.abs() <= math.log(correction_cap)).to(w.dtype).unsqueeze(-1)
        weight, is_masked = keep.expand_as(w), (1 - keep) * mask

    if loss_type == "gspo":
        seq_log_ratio = ((logprobs - old) * mask).sum(-1) / seq_tokens.clamp(min=1)  # [B]
        # Per-token ratio whose value is the sequence ratio but whose gradient flows per token.
        log_ratio = seq_log_ratio.detach().unsqueeze(-1) + logprobs - logprobs.detach()
    else:
        log_ratio = logprobs - old
    ratio = torch.exp(log_ratio)
    clipped = ratio.clamp(1 - epsilon, 1 + eps_hi)
    per_token = -torch.minimum(ratio * adv, clipped * adv) * weight
    if ref_logprobs is not None and beta > 0:
        d = ref_logprobs - logprobs
        per_token = per_token + beta * (torch.exp(d) - d - 1)  # k3 estimator of KL(pi || ref)
    per_token = per_token * mask

    if loss_type in ("grpo", "gspo"):
        loss = ((per_token.sum(-1) / seq_tokens.clamp(min=1)) * seq_on).sum() / max(n_seq, 1)
    elif loss_type == "dapo":
        loss = per_token.sum() / max(n_tok, 1)
    elif loss_type == "dr_grpo":
        L = max_completion_length or logprobs.shape[-1]
        loss = per_token.sum() / (max(n_seq, 1) * L)
    else:
        raise ValueError(f"unknown loss_type {loss_type!r}")

    with torch.no_grad():
        r = ratio.detach()
        low = ((r < 1 - epsilon) & (adv < 0)).to(mask.dtype)
        high = ((r > 1 + eps_hi) & (adv > 0)).to(mask.dtype)
        valid = mask > 0
        metrics = {
            "loss": float(loss.detach()),
            "clip_frac_low": _masked_mean(low, mask),
            "clip_frac_high": _masked_mean(high, mask),
            "ratio_mean": _masked_mean(r, mask),
            "ratio_min": float(r[valid].min()) if valid.any() else 1.0,
            "ratio_max": float(r[valid].max()) if valid.any() else 1.0,
            # k3 estimate of KL(mu || pi_old) from the sampler's tokens: the mismatch to correct.
            "mismatch_kl": _masked_mean(torch.exp(log_w) - log_w - 1, mask),
            "is_weight_mean": _masked_mean(weight, mask),
            "is_masked_frac": _masked_mean(is_masked, mask),
            "entropy_proxy": -_masked_mean(logprobs.detach(), mask),
        }
        if ref_logprobs is not None:
            d = ref_logprobs - logprobs.detach()
            metrics["kl"] = _masked_mean(torch.exp(d) - d - 1, mask)
    return loss, metrics

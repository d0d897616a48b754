"""A micro-batch's prompts and completions as one row of tokens, with no padding: each distinct prompt
once, then each of its completions, and attention computed by segment (`segment_hidden`).

The decoder's linear layers, norms and MLPs run on the real tokens only. Attention runs in two batched
calls per layer instead of one dense one over the row: the prompts, causal, each padded to the longest
prompt; and the completions, each attending to its own prompt's keys and to its own earlier tokens,
padded to the longest completion. A row of dense attention would cost the square of the whole
micro-batch's tokens; by segment it costs a prompt's square plus a completion's tokens times its
prompt's and its own, the pairs a token attends to, up to the padding.

The attention function is registered with transformers (`AttentionInterface`) under `IMPLEMENTATION`
and put in place on the decoder's config for the one forward (`segment_hidden`). It receives the
queries, keys and values after the rotary embedding, so everything else in the layers is the model's
own code; positions count within each sequence, and a sliding window (per layer type for Gemma 3 and
Qwen, model-wide for Mistral) is applied by those positions. The logprobs and gradients are the padded
forward's (tests/unit/test_shared_prompts.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

import torch
import torch.nn.functional as F
from transformers import AttentionInterface

if TYPE_CHECKING:
    from grpoflow.tasks.learner.learner_api import TrainSample

IMPLEMENTATION = "grpoflow_segments"


class Segments(NamedTuple):
    """A micro-batch as one row of N tokens, and where attention finds each segment's tokens in it."""

    ids: torch.Tensor  # [1, N] token ids: each prompt, then its completions
    positions: torch.Tensor  # [1, N] each token's position in its own sequence
    prompt: torch.Tensor  # [R, P] the row index of prompt r's token j (padding: 0)
    query: torch.Tensor  # [G, C] the row index of completion g's token i (padding: 0)
    key: torch.Tensor  # [G, P + C] what completion g attends to: its prompt (P, padded), then itself
    key_pos: torch.Tensor  # [G, P + C] those keys' positions; -1: padding, never attended
    query_pos: torch.Tensor  # [G, C] completion g's positions, p..p+C-1 (its padding's too)
    back: torch.Tensor  # [N] each token's place in the prompts' [R*P] then the completions' [G*C] outputs
    row: torch.Tensor  # [B, T] the row index of the state that predicts sample b's completion token t


def segments(mb: list[TrainSample], which: list[int], prompts: list[tuple[int, ...]]) -> Segments:
    """`mb`'s samples as one row: prompt r (`prompts[r]`, sample i's is `which[i]`) then its samples'
    completions in `mb`'s order."""
    R, G = len(prompts), len(mb)
    P, C = max(len(p) for p in prompts), max(max(len(s.completion_mask) for s in mb), 1)
    members: list[list[int]] = [[] for _ in range(R)]
    for i, r in enumerate(which):
        members[r].append(i)
    ids, positions, back = [], [], []
    prompt = torch.zeros((R, P), dtype=torch.long)
    query = torch.zeros((G, C), dtype=torch.long)
    key = torch.zeros((G, P + C), dtype=torch.long)
    key_pos = torch.full((G, P + C), -1, dtype=torch.long)
    query_pos = torch.zeros((G, C), dtype=torch.long)
    row = torch.zeros((G, C), dtype=torch.long)
    for r, m in enumerate(members):
        p, at = len(prompts[r]), len(ids)
        prompt[r, :p] = torch.arange(at, at + p)
        ids += prompts[r]
        positions += range(p)
        back += range(r * P, r * P + p)
        for g in m:
            n, at = len(mb[g].completion_mask), len(ids)
            ids += mb[g].input_ids[p:]
            positions += range(p, p + n)
            back += range(R * P + g * C, R * P + g * C + n)
            query[g, :n] = torch.arange(at, at + n)
            query_pos[g] = torch.arange(p, p + C)
            key[g, :p], key[g, P : P + n] = prompt[r, :p], query[g, :n]
            key_pos[g, :p], key_pos[g, P : P + n] = torch.arange(p), torch.arange(p, p + n)
            # token 0 is predicted by the prompt's last state, token t by the completion's token t-1
            row[g, :n] = torch.cat([prompt[r, p - 1 : p], query[g, : n - 1]])[:n]
    T = max(len(s.completion_mask) for s in mb)
    return Segments(
        torch.tensor([ids]),
        torch.tensor([positions]),
        prompt,
        query,
        key,
        key_pos,
        query_pos,
        torch.tensor(back),
        row[:, :T],
    )


def segment_hidden(decoder, seg: Segments, device: torch.device) -> torch.Tensor:
    """[B, T, H]: the decoder's states over the row `seg` that predict each sample's completion tokens,
    attention by segment (`segment_attention`, in place on the decoder's config for this forward)."""
    seg = Segments(*(t.to(device) for t in seg))
    config, before = decoder.config, decoder.config._attn_implementation
    config._attn_implementation = IMPLEMENTATION
    try:
        out = decoder(input_ids=seg.ids, position_ids=seg.positions, use_cache=False, segments=seg)
    finally:
        config._attn_implementation = before
    return out.last_hidden_state[0][seg.row]


def segment_attention(
    module,
    query,
    key,
    value,
    attention_mask,
    dropout: float = 0.0,
    scaling=None,
    sliding_window=None,
    segments: Segments | None = None,
    **kwargs,
):
    """transformers' attention interface over one row (`query` [1, H, N, D], `key`/`value` [1, KV, N, D])
    laid out as `segments` says: [1, N, H, D] out, as its `sdpa_attention_forward` gives. `sliding_window`:
    the layer's own (Gemma 3, Qwen), the model's (Mistral), or none (Llama)."""
    if segments is None:
        raise ValueError(f"attention {IMPLEMENTATION!r} runs only inside segment_hidden's forward")
    s = segments
    q, k, v = query[0], key[0], value[0]  # [H, N, D]
    scale = scaling if scaling is not None else q.shape[-1] ** -0.5

    def take(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:  # [H, N, D] -> [rows, H, cols, D]
        return x.index_select(1, index.reshape(-1)).unflatten(1, index.shape).transpose(0, 1)

    # Prompts: causal; padding (after a prompt's end) is seen by padding only.
    pos = torch.arange(s.prompt.shape[1], device=q.device)
    head_mask = _allowed(pos[:, None], pos[None, :], sliding_window)
    head = _attend(take(q, s.prompt), take(k, s.prompt), take(v, s.prompt), head_mask, scale, dropout)
    # Completions: the prompt's real keys and their own earlier tokens; a padded query sees its prompt's
    # first token, so that no softmax is empty (its output is never read).
    real = s.key_pos[:, None, :] >= 0
    mask = _allowed(s.query_pos[:, :, None], s.key_pos[:, None, :], sliding_window) & real
    mask[:, :, 0] |= ~mask.any(-1)
    tail = _attend(take(q, s.query), take(k, s.key), take(v, s.key), mask[:, None], scale, dropout)
    out = torch.cat([head.transpose(0, 1).flatten(1, 2), tail.transpose(0, 1).flatten(1, 2)], dim=1)
    return out.index_select(1, s.back).transpose(0, 1)[None], None


def _allowed(qpos: torch.Tensor, kpos: torch.Tensor, window: int | None) -> torch.Tensor:
    """Causal by position, within `window` positions if set (transformers' sliding window: q - k < w)."""
    ok = kpos <= qpos
    return ok & (qpos - kpos < window) if window is not None else ok


# Above this many query-key pairs in one call (all heads), attention runs in torch's fused kernel, which
# keeps no [.., Q, K] probabilities for the backward: 4M pairs keep about 24 MB a layer.
MATRIX_PAIRS = 1 << 22


def _attend(q, k, v, mask, scale: float, dropout: float) -> torch.Tensor:
    """Softmax attention of q [B, H, Q, D] over k, v [B, KV, K, D] (each KV head shared by H/KV query
    heads, as transformers' repeat_kv pairs them) where `mask` [.., Q, K] allows. Up to `MATRIX_PAIRS`,
    as matrix products with the query heads of one KV head stacked and a float32 softmax (transformers'
    eager attention): on a CPU 2-5x faster than torch's fused attention, forward and backward, at a
    group's blocks (BENCHMARKS.md). Above, the fused kernel."""
    B, H, Q, D = q.shape
    KV, K = k.shape[1], k.shape[2]
    if B * H * Q * K > MATRIX_PAIRS:
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, dropout_p=dropout, scale=scale, enable_gqa=KV != H
        )
    scores = (q.reshape(B, KV, H // KV * Q, D) @ k.transpose(-1, -2)).view(B, H, Q, K) * scale
    probs = scores.float().masked_fill(~mask, float("-inf")).softmax(-1).to(v.dtype)
    if dropout:
        probs = F.dropout(probs, dropout)
    return (probs.view(B, KV, H // KV * Q, K) @ v).view(B, H, Q, D)


AttentionInterface.register(IMPLEMENTATION, segment_attention)

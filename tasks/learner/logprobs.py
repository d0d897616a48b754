"""The policy's logprobs of completion tokens: the forward passes a train step runs.

A micro-batch's forward gives [B, T] completion logprobs aligned with its masks. Two ways, the same
result: every sequence padded and run whole (`padded_logprobs`), or each distinct prompt run once
(`shared_prompt_logprobs`; the learner's `share_prompt`). A shared prompt runs in one of two layouts.
With the LM head apart (below): the prompts and completions as one row of tokens, no padding, and
attention by segment (tasks/learner/segments.py: one forward). Otherwise: its KV cache row repeated for
its completions, each padded to the micro-batch's longest (a second forward over the cache).

Both run the LM head apart from the decoder, on the positions that predict a completion's own tokens
only (`completion_logprobs`), for the models `split_head` knows and one learner process (FSDP2 gathers
the head's tied weights only inside the whole model's forward): a micro-batch's completions are padded
to its longest, and padding then costs no head matmul and no [*, vocab] float32 logits (12-41% of the
positions in a SmolLM2 demo run).

With `head_chunk` (the learner's `lm_head_chunk`), the LM head runs on `head_chunk` positions at a time
over the decoder's hidden states, and each chunk's float32 logits are recomputed in the backward
(activation checkpointing) instead of kept: the [tokens, vocab] logits, a step's largest tensor at a
150k vocabulary, never exist whole. The logprobs and gradients are the whole head's (the same matmuls
by rows); models whose logits are more than head(hidden states) are run whole (`split_head`).
"""

from __future__ import annotations

import inspect
from typing import TYPE_CHECKING, NamedTuple

import torch
from torch.utils.checkpoint import checkpoint

from grpoflow.tasks.learner.segments import segment_hidden, segments

if TYPE_CHECKING:
    from grpoflow.tasks.learner.learner_api import TrainSample


class MicroBatch(NamedTuple):
    """One micro-batch's forward: completion logprobs and the loss's inputs, aligned."""

    logprobs: torch.Tensor  # [B, T]
    mask: torch.Tensor  # [B, T] completion tokens the loss counts
    behaviour: torch.Tensor  # [B, T] logprobs the sampler reported
    advantages: torch.Tensor  # [B]


def token_logprobs(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, temperature: float):
    """log p(x_t | x_<t) for t >= 1, shape [B, L-1]; logits scaled by the sampling temperature,
    because vLLM reports processed (post-temperature) logprobs and the ratio must compare like with like."""
    return logprobs_from(model, input_ids, attention_mask, temperature, first=0)


def logprobs_from(model, input_ids, attention_mask, temperature: float, first: int) -> torch.Tensor:
    """log p(x_{t+1} | x_<=t) for positions t = first .. L-2, shape [B, L-1-first].

    The LM head runs only on positions >= `first` (transformers' `logits_to_keep`): prompt positions
    need no logits, and on a 49k vocabulary the head and its [B, L, V] float32 logits are a large
    share of a CPU train step."""
    L = input_ids.shape[1]
    targets = input_ids[:, first + 1 :]
    kwargs = {"logits_to_keep": L - first} if first > 0 and _takes_logits_to_keep(model) else {}
    # No KV cache: nothing reuses it, yet transformers builds one by default, and under torch.compile
    # its per-layer state makes dynamo recompile each decoder layer until it gives up on them.
    logits = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False, **kwargs).logits
    return picked_logprobs(logits[:, -(L - first) : -1], targets, temperature)


def picked_logprobs(logits: torch.Tensor, targets: torch.Tensor, temperature: float) -> torch.Tensor:
    """log-softmax of temperature-scaled float32 logits [B, T, V] at `targets` [B, T]."""
    logits = logits.float()
    if temperature != 1.0:
        logits = logits / temperature
    # gather - logsumexp avoids materialising a full [B, T, V] log_softmax copy.
    picked = logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    return picked - torch.logsumexp(logits, dim=-1)


# Causal LMs whose logits are lm_head(the decoder's last hidden state), then the config's
# `final_logit_softcapping` if set, and nothing else (transformers' *ForCausalLM.forward).
HEAD_SPLIT_MODELS = frozenset({"llama", "mistral", "qwen2", "qwen3", "gemma3_text"})


class SplitHead(NamedTuple):
    decoder: torch.nn.Module  # input ids -> last hidden state (and the KV cache)
    head: torch.nn.Module  # hidden state -> logits
    softcap: float | None  # logits = softcap * tanh(logits / softcap)


def split_head(model) -> SplitHead | None:
    """`model`'s decoder and LM head, for a model of HEAD_SPLIT_MODELS (peft's wrapper too: its adapters
    sit inside the modules); None for any other, which then runs whole."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    if getattr(base.config, "model_type", None) not in HEAD_SPLIT_MODELS:
        return None
    cap = getattr(base.config, "final_logit_softcapping", None)
    return SplitHead(base.get_decoder(), base.get_output_embeddings(), cap)


def head_chunk_of(model, chunk: int | None, world_size: int) -> int | None:
    """`learner.lm_head_chunk` for this model, or a clear error naming the field."""
    if chunk is None:
        return None
    if split_head(model) is None:
        kind = getattr(model.config, "model_type", type(model).__name__)
        raise ValueError(
            f"learner.lm_head_chunk: a {kind} model's logits are not its LM head's alone "
            f"(chunked for {', '.join(sorted(HEAD_SPLIT_MODELS))}); leave it unset"
        )
    if world_size > 1:  # FSDP2 unshards the root module's own weights in the root's forward alone
        raise ValueError("learner.lm_head_chunk: with learner.world_size 1 only; leave it unset")
    return chunk


def head_logprobs(split: SplitHead, hidden: torch.Tensor, targets: torch.Tensor, temperature: float):
    """`picked_logprobs` of the LM head's (soft-capped) logits over `hidden` [..., H] at `targets` [...]."""
    logits = split.head(hidden)
    if split.softcap is not None:
        logits = torch.tanh(logits / split.softcap) * split.softcap
    return picked_logprobs(logits, targets, temperature)


def chunked_logprobs(
    split: SplitHead, hidden: torch.Tensor, targets: torch.Tensor, temperature: float, chunk: int
) -> torch.Tensor:
    """`head_logprobs` over `hidden` [..., H] at `targets` [...], `chunk` positions at a time, each
    chunk's logits recomputed in the backward rather than kept."""
    flat, want = hidden.reshape(-1, hidden.shape[-1]), targets.reshape(-1)

    def piece(h: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return head_logprobs(split, h, t, temperature)

    parts = [
        checkpoint(piece, flat[i : i + chunk], want[i : i + chunk], use_reentrant=False)
        if torch.is_grad_enabled()
        else piece(flat[i : i + chunk], want[i : i + chunk])
        for i in range(0, flat.shape[0], chunk)
    ]
    return torch.cat(parts).view(targets.shape)


def completion_logprobs(
    split: SplitHead,
    hidden: torch.Tensor,
    targets: torch.Tensor,
    real: torch.Tensor,
    temperature: float,
    chunk: int | None,
) -> torch.Tensor:
    """[B, T] logprobs of `targets` from `hidden` [B, T, H], with the LM head run on the `real` [B, T]
    positions only (each completion's own tokens; padding gets 0, which every mask leaves out):
    padding costs no head matmul and no [*, V] float32 logits. `chunk` positions at a time if set."""
    sel, want = hidden[real], targets[real]
    if chunk:
        picked = chunked_logprobs(split, sel, want, temperature, chunk)
    else:
        picked = head_logprobs(split, sel, want, temperature)
    return torch.zeros(targets.shape, dtype=picked.dtype, device=picked.device).masked_scatter(real, picked)


def _takes_logits_to_keep(model) -> bool:
    return "logits_to_keep" in inspect.signature(model.forward).parameters


def _completion_tensors(mb: list[TrainSample], T: int) -> tuple[torch.Tensor, ...]:
    """[B, T] completion mask and behaviour logprobs, right-padded with zeros, [B] advantages, and the
    [B, T] positions that hold a completion's own tokens (not padding)."""
    mask, behav = torch.zeros((len(mb), T)), torch.zeros((len(mb), T))
    real = torch.zeros((len(mb), T), dtype=torch.bool)
    for i, s in enumerate(mb):
        t = len(s.completion_mask)
        mask[i, :t] = torch.tensor(s.completion_mask, dtype=torch.float)
        behav[i, :t] = torch.tensor(s.behaviour_logprobs, dtype=torch.float)
        real[i, :t] = True
    return mask, behav, torch.tensor([s.advantage for s in mb], dtype=torch.float), real


def padded_logprobs(
    model,
    mb: list[TrainSample],
    *,
    temperature: float,
    pad_id: int,
    device: torch.device,
    head_chunk: int | None = None,
    head_apart: bool = True,
) -> MicroBatch:
    """Each sequence right-padded and run whole. With `head_apart` (one learner process; a model of
    HEAD_SPLIT_MODELS) the LM head runs on the positions that predict completion tokens only
    (`completion_logprobs`); else on the grid that starts at the first such position, and the
    logprobs are gathered from it."""
    L = max(len(s.input_ids) for s in mb)
    T = max(len(s.completion_mask) for s in mb)
    B = len(mb)
    ids = torch.full((B, L), pad_id, dtype=torch.long)
    attn = torch.zeros((B, L), dtype=torch.long)
    first = min(s.prompt_len for s in mb) - 1
    index = torch.zeros((B, T), dtype=torch.long)  # position in the [B, L-1-first] logprob grid
    for i, s in enumerate(mb):
        n, t = len(s.input_ids), len(s.completion_mask)
        ids[i, :n] = torch.tensor(s.input_ids)
        attn[i, :n] = 1
        # completion token j sits at input position P+j and is predicted from position P+j-1
        index[i, :t] = torch.arange(s.prompt_len - 1 - first, s.prompt_len - 1 - first + t)
    mask, behav, adv, real = (t.to(device) for t in _completion_tensors(mb, T))
    ids, attn, index = ids.to(device), attn.to(device), index.to(device)
    if (head_apart or head_chunk) and (split := split_head(model)):
        # No KV cache, as in logprobs_from.
        hidden = split.decoder(input_ids=ids, attention_mask=attn, use_cache=False).last_hidden_state
        at = index + first  # the input position that predicts each completion token (padding: any)
        picked = hidden.gather(1, at[..., None].expand(-1, -1, hidden.shape[-1]))
        lp = completion_logprobs(split, picked, ids.gather(1, at + 1), real, temperature, head_chunk)
        return MicroBatch(lp, mask, behav, adv)
    lp = logprobs_from(model, ids, attn, temperature, first)
    return MicroBatch(lp.gather(1, index), mask, behav, adv)


def shared_prompt_logprobs(
    model,
    mb: list[TrainSample],
    *,
    temperature: float,
    pad_id: int,
    device: torch.device,
    head_chunk: int | None = None,
    head_apart: bool = True,
    layout: str | None = None,
) -> MicroBatch:
    """`padded_logprobs`'s result with each distinct prompt run once, in `layout`: "segments" (the LM
    head apart: `head_apart` or `head_chunk`, a model split_head knows) or "cached"; None: segments where
    the head runs apart. Segments: one row of tokens, attention by segment (`segment_hidden`). Cached:
    the prompts left-padded to one length (position ids from each one's first real token), each
    completion continuing its prompt's KV cache row (gradients flow through it)."""
    which, prompts = prompt_rows(mb)
    dev = device
    P, B, T = max(len(p) for p in prompts), len(mb), max(len(s.completion_mask) for s in mb)
    comp = torch.full((B, T), pad_id, dtype=torch.long)
    for i, s in enumerate(mb):
        comp[i, : len(s.completion_mask)] = torch.tensor(s.input_ids[s.prompt_len :])
    comp, index = comp.to(dev), torch.tensor(which, device=dev)
    mask, behav, adv, real = (t.to(device) for t in _completion_tensors(mb, T))
    split = split_head(model) if head_apart or head_chunk else None
    if layout == "segments" and not split:
        raise ValueError("shared_prompt_logprobs: the segments layout needs the LM head apart")
    if split and layout != "cached":
        hidden = segment_hidden(split.decoder, segments(mb, which, prompts), dev)
        lp = completion_logprobs(split, hidden, comp, real, temperature, head_chunk)
        return MicroBatch(lp, mask, behav, adv)
    head_ids = torch.full((len(prompts), P), pad_id, dtype=torch.long)
    head_attn = torch.zeros((len(prompts), P), dtype=torch.long)
    for j, p in enumerate(prompts):
        head_ids[j, P - len(p) :] = torch.tensor(p)
        head_attn[j, P - len(p) :] = 1
    ragged = any(len(p) != P for p in prompts)
    head_kw, tail_kw = {}, {}
    if ragged:  # equal lengths need no mask and count positions from 0 already
        lengths = torch.tensor([len(p) for p in prompts], device=dev)
        head_attn = head_attn.to(dev)
        head_kw = {"attention_mask": head_attn, "position_ids": (head_attn.cumsum(-1) - 1).clamp(min=0)}
        # Right padding after a completion's real tokens: causal attention keeps it out of them.
        tail_attn = torch.cat([head_attn[index], torch.ones((B, T), dtype=torch.long, device=dev)], 1)
        positions = lengths[index, None] + torch.arange(T, device=dev)
        tail_kw = {"attention_mask": tail_attn, "position_ids": positions}
    if split:
        head = split.decoder(input_ids=head_ids.to(dev), use_cache=True, **head_kw)
        head.past_key_values.batch_select_indices(index)  # prompt row -> one row per completion
        tail = split.decoder(input_ids=comp, past_key_values=head.past_key_values, use_cache=True, **tail_kw)
        hidden = torch.cat([head.last_hidden_state[index, -1:], tail.last_hidden_state[:, :-1]], dim=1)
        lp = completion_logprobs(split, hidden, comp, real, temperature, head_chunk)
        return MicroBatch(lp, mask, behav, adv)
    head = model(input_ids=head_ids.to(dev), use_cache=True, logits_to_keep=1, **head_kw)
    cache = head.past_key_values
    cache.batch_select_indices(index)  # prompt row -> one row per completion
    tail = model(input_ids=comp, past_key_values=cache, use_cache=True, **tail_kw).logits
    logits = torch.cat([head.logits[index, -1:], tail[:, :-1]], dim=1)
    return MicroBatch(picked_logprobs(logits, comp, temperature), mask, behav, adv)


def prompt_rows(mb: list[TrainSample]) -> tuple[list[int], list[tuple[int, ...]]]:
    """Each sample's prompt as a row index, and the distinct prompts in that order (first seen first)."""
    rows: dict[tuple[int, ...], int] = {}
    which = [rows.setdefault(tuple(s.input_ids[: s.prompt_len]), len(rows)) for s in mb]
    return which, list(rows)

"""Reward functions used by the shipped configs.

Signature (TRL-style): `fn(prompts, completions, completion_ids, environments, **columns)` returning
one value per completion; None means "no meaningful score" and masks the completion out.
"""

from __future__ import annotations

import asyncio
import itertools
import re
import time

_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")
_TAGGED = re.compile(r"<answer>\s*(-?\d+(?:\.\d+)?)\s*</answer>")


def letter_fraction(completions: list[str], target_letter: str = "a", **_) -> list[float | None]:
    """Fraction of the completion's characters equal to `target_letter` (case-insensitive).

    An empty completion has no meaningful score: None (invalid), not 0.
    """
    t = target_letter.lower()
    return [sum(ch == t for ch in c.lower()) / len(c) if c else None for c in completions]


def exact_number(completions: list[str], answer: list | None = None, **_) -> list[float | None]:
    """1.0 if the last number in the completion equals the row's `answer`, else 0.0.

    None when the row has no answer (nothing to compare against).
    """
    answers = answer or [None] * len(completions)
    out: list[float | None] = []
    for text, ans in zip(completions, answers, strict=True):
        if ans is None:
            out.append(None)
            continue
        nums = _NUMBER.findall(text)
        out.append(1.0 if nums and abs(float(nums[-1]) - float(ans)) < 1e-6 else 0.0)
    return out


def number_only(
    completions: list[str], answer: list | None = None, max_words: int = 8, **_
) -> list[float | None]:
    """Partial credit for 'reply with only the number', in [0, 1]: half for brevity (1 for a reply of
    one word, falling linearly to 0 at `max_words` + 1 words), half for correctness (the reply's last
    number equals the row's `answer`). None when the row has no answer."""
    out: list[float | None] = []
    for text, correct in zip(completions, exact_number(completions, answer), strict=True):
        words = len(text.split())
        brevity = 0.0 if words == 0 else max(0.0, 1.0 - (words - 1) / max_words)  # empty: no answer
        out.append(None if correct is None else 0.5 * brevity + 0.5 * correct)
    return out


def answer_format(completions: list[str], **_) -> list[float]:
    """R1-Zero's format reward: 1.0 when the completion gives one number in <answer> </answer> tags
    and ends there (configs/gemma3-r1zero.yaml stops generation at "</answer>"), else 0.0."""
    return [
        1.0 if len(_TAGGED.findall(c)) == 1 and c.rstrip().endswith("</answer>") else 0.0 for c in completions
    ]


def answer_correct(completions: list[str], answer: list | None = None, **_) -> list[float | None]:
    """R1-Zero's accuracy reward: 1.0 when the number in the completion's first <answer> tags equals the
    row's `answer`, else 0.0 (no tags: 0.0). None when the row has no answer."""
    answers = answer or [None] * len(completions)
    out: list[float | None] = []
    for text, ans in zip(completions, answers, strict=True):
        found = _TAGGED.search(text)
        out.append(
            None
            if ans is None
            else float(found is not None and abs(float(found.group(1)) - float(ans)) < 1e-6)
        )
    return out


def soft_overlong_penalty(completion_ids: list[list[int]], max_tokens: int, buffer: int, **_) -> list[float]:
    """DAPO's soft overlong punishment (Yu et al. 2025, eq. 13): 0 for a completion of at most
    `max_tokens` - `buffer` tokens, then falling linearly to -1 over the last `buffer` tokens of the
    budget, and -1 beyond it. Set `max_tokens` to the budget the completions are cut at
    (generation.max_tokens, or generation.max_rollout_tokens for multi-turn rollouts, whose
    completion_ids hold tool results too) and add it beside the task's reward:

        - {name: overlong, fn: grpoflow.examples.rewards:soft_overlong_penalty, kwargs: {max_tokens: 512, buffer: 128}}
    """
    if not 0 < buffer <= max_tokens:
        raise ValueError(f"soft_overlong_penalty: buffer {buffer} must be in 1..max_tokens ({max_tokens})")
    free = max_tokens - buffer
    return [0.0 if len(ids) <= free else max(-1.0, (free - len(ids)) / buffer) for ids in completion_ids]


def env_reward(environments: list, **_) -> list[float | None]:
    """The environment snapshot's reward: `get_reward()` if it has one, else its `reward` attribute."""
    out = []
    for env in environments:
        if env is None:
            out.append(None)
        elif hasattr(env, "get_reward"):
            out.append(env.get_reward())
        else:
            out.append(getattr(env, "reward", None))
    return out


# --- slow rewards for the scoring benchmark ---------------------------------------------------


def slow_sync(completions: list[str], delay: float = 0.2, **_) -> list[float]:
    time.sleep(delay)
    return [float(len(c)) for c in completions]


async def slow_async(completions: list[str], delay: float = 0.2, **_) -> list[float]:
    await asyncio.sleep(delay)
    return [float(len(c)) for c in completions]


# --- misbehaving rewards and tools, for fault drills (configs/tiny-faults.yaml, benchmarks/faults.py) --


def _unit(*parts: object) -> float:
    """A deterministic pseudo-random number in [0, 1) from `parts` (stable across processes)."""
    import hashlib

    digest = hashlib.blake2b(repr(parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2**64


def chaos_letters(
    completions: list[str], fail_rate: float = 0.3, target_letter: str = "a", **_
) -> list[float | None]:
    """letter_fraction, except that exactly floor(`fail_rate` x n) of the n values come back broken, in
    mixed ways: None and NaN (status `invalid`) and a string (status `failed`: the whole call's values
    are rejected only when the length is wrong, so a non-numeric value fails just its own cell). Which
    positions break depends on the position only, never on the generated text, so the rate is the
    same whatever the model writes (an empty completion scores 0.0 here, not None as in
    letter_fraction, so that only the chosen cells are broken)."""
    n = len(completions)
    broken = sorted(range(n), key=lambda i: _unit(i, n))[: int(fail_rate * n)]
    kinds = {i: k % 3 for k, i in enumerate(broken)}  # None, NaN, string in turn
    out: list[float | str | None] = []
    for i, value in enumerate(letter_fraction(completions, target_letter)):
        kind = kinds.get(i)
        if kind is None:
            out.append(0.0 if value is None else value)
        else:
            out.append((None, float("nan"), "not a number")[kind])
    return out  # type: ignore[return-value]


_STUCK_CALLS = itertools.count()


def sometimes_stuck(
    completions: list[str], pattern: str = "ok,hang,ok,raise", hang_s: float = 3600.0, **_
) -> list[float]:
    """A whole-batch reward that, call after call, follows `pattern`: `ok`, `hang` (far past any sane
    timeout) or `raise`; a flaky remote judge."""
    mode = pattern.split(",")[next(_STUCK_CALLS) % len(pattern.split(","))].strip()
    if mode == "hang":
        time.sleep(hang_s)
    elif mode == "raise":
        raise RuntimeError("reward service unavailable")
    return [float(len(c)) / 100 for c in completions]

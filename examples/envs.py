"""Environments and small datasets used by the shipped configs."""

from __future__ import annotations

import random


class CounterEnv:
    """A stateful counter: `reset` sets it to 0, the `increment` tool adds to it, reward = count."""

    def __init__(self) -> None:
        self.count = 0
        self.calls = 0

    def reset(self, **row) -> str:
        self.count = 0
        self.calls = 0
        return "A counter starts at 0. Call the increment tool to raise it."

    def increment(self, by: int = 1) -> str:
        """Add to the counter.

        Args:
            by: How much to add (1 to 5).
        """
        if not 1 <= int(by) <= 5:
            raise ValueError("by must be between 1 and 5")
        self.count += int(by)
        self.calls += 1
        return f"count is now {self.count}"

    def get_reward(self) -> float:
        return float(self.count)


def user(text: str) -> list[dict]:
    """A conversational prompt (TRL's format): these rows are for chat models, so they go through the
    chat template; a plain-text prompt would be sent as it is."""
    return [{"role": "user", "content": text}]


_WORDS = ["apple", "river", "stone", "cloud", "garden", "window", "forest", "candle", "silver", "harbor"]


def letters_rows(n: int = 64, seed: int = 0) -> list[dict]:
    """Prompts for the tiny-letters demo (the reward looks only at the completion)."""
    rng = random.Random(seed)
    return [
        {"prompt": user(f"Write a word like {rng.choice(_WORDS)} with many letters a."), "id": i}
        for i in range(n)
    ]


def arith_rows(n: int = 256, seed: int = 0, hi: int = 40) -> list[dict]:
    """Short arithmetic word problems with integer answers; operands up to `hi` (multipliers up to 9)."""
    if hi < 2:
        raise ValueError(f"hi must be at least 2, got {hi}")
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        a, b, c = rng.randint(2, hi), rng.randint(2, hi), rng.randint(2, min(9, hi))
        kind = i % 3
        if kind == 0:
            q, ans = f"Tom has {a} apples and buys {b} more. How many apples does he have?", a + b
        elif kind == 1:
            q, ans = f"A box holds {c} rows of {a} eggs. How many eggs are in the box?", a * c
        else:
            q, ans = f"Ann had {a + b} stickers and gave away {b}. How many are left?", a
        rows.append({"prompt": user(f"{q} Answer with the number only."), "answer": ans, "id": i})
    return rows


def sum_rows(n: int = 512, seed: int = 0, hi: int = 20, part: str = "train") -> list[dict]:
    """'What is a + b? Reply with only the number.' with 1 <= a, b <= `hi` (the SmolLM2 demo).

    `part`: 'train' draws only pairs outside the held-out fifth, 'eval' only pairs inside it (a fixed
    split by the pair itself, so no eval prompt is ever a training prompt, whatever the seeds)."""
    rows = []
    for i, (a, b) in enumerate(_sum_pairs(n, seed, hi, part)):
        # eval rows' ids differ from training rows' ids: an eval split drawn from `part: eval` leaves out
        # of training exactly the rows with its ids (flows/training/data.py: split_rows)
        rid = i if part == "train" else f"eval-{i}"
        rows.append(
            {"prompt": user(f"What is {a} + {b}? Reply with only the number."), "answer": a + b, "id": rid}
        )
    return rows


# One worked example shows the format; the rewards (examples/rewards.py: answer_format, answer_correct)
# score it. A 270M base model given the instruction alone rambles and almost never writes the tags.
R1_ZERO = (
    "Each answer ends with the final number in <answer> </answer> tags.\n"
    "Question: What is 3 + 4?\nAnswer: 3 + 4 = 7. <answer>7</answer>\n"
    "Question: What is {a} + {b}?\nAnswer:"
)


def sum_text_rows(n: int = 512, seed: int = 0, hi: int = 20, part: str = "train") -> list[dict]:
    """Plain-text prompts for a base model, R1-Zero style (configs/gemma3-r1zero.yaml): a line naming the
    answer's format and one worked example, then "Question: What is a + b?\nAnswer:" with
    1 <= a, b <= `hi`. Sent as they are (no chat template). `part` splits pairs as `sum_rows` does."""
    return [
        {"prompt": R1_ZERO.format(a=a, b=b), "answer": a + b, "id": i if part == "train" else f"eval-{i}"}
        for i, (a, b) in enumerate(_sum_pairs(n, seed, hi, part))
    ]


def _sum_pairs(n: int, seed: int, hi: int, part: str) -> list[tuple[int, int]]:
    """`n` pairs 1 <= a, b <= `hi` drawn with `seed`, from the training pairs or the held-out fifth."""
    if hi < 1:
        raise ValueError(f"hi must be at least 1, got {hi}")
    if part not in ("train", "eval"):
        raise ValueError(f"part must be 'train' or 'eval', got {part!r}")
    pairs = [
        (a, b) for a in range(1, hi + 1) for b in range(1, hi + 1) if _held_out(a, b) == (part == "eval")
    ]
    rng = random.Random(seed)
    return [rng.choice(pairs) for _ in range(n)]


def product_rows(n: int = 512, seed: int = 0, part: str = "train") -> list[dict]:
    """'What is a * b?' with a three-digit `a` and a two-digit `b`, to be answered with the calculator
    tool (configs/smollm2-tools.yaml): a 135M model cannot multiply these in its head, so the reward
    rises only as its tool calls succeed. `part` splits pairs as `sum_rows` does."""
    if part not in ("train", "eval"):
        raise ValueError(f"part must be 'train' or 'eval', got {part!r}")
    rng = random.Random(seed)
    rows: list[dict] = []
    while len(rows) < n:
        a, b = rng.randint(100, 999), rng.randint(11, 99)
        if _held_out(a, b) != (part == "eval"):
            continue
        prompt = f"What is {a} * {b}? Use the calculator, then reply with only the number."
        i = len(rows)
        rows.append(
            {
                "prompt": user(prompt),
                "answer": a * b,
                "a": a,
                "b": b,
                "id": i if part == "train" else f"eval-{i}",
            }
        )
    return rows


def _held_out(a: int, b: int) -> bool:
    return (a * 7 + b * 13) % 5 == 0

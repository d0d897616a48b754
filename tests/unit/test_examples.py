"""The shipped demo task's data and reward: a held-out split that training never draws, and a reward
in [0, 1] that pays for exactly what the prompt asks (only the number, and the right one)."""

from __future__ import annotations

import pytest

from grpoflow.examples.envs import sum_rows
from grpoflow.examples.rewards import number_only

pytestmark = pytest.mark.unit


def test_eval_prompts_are_never_training_prompts_whatever_the_seeds():
    train = {r["prompt"][0]["content"] for seed in range(5) for r in sum_rows(512, seed=seed)}
    held_out = {r["prompt"][0]["content"] for seed in range(5) for r in sum_rows(512, seed=seed, part="eval")}
    assert train and held_out and not train & held_out
    assert len(held_out) == 80 and len(train) <= 320  # a fixed fifth of the 400 pairs is held out
    row = sum_rows(1, seed=3)[0]
    assert [m["role"] for m in row["prompt"]] == ["user"]  # for chat models: through the chat template
    a, b = (int(x) for x in row["prompt"][0]["content"].removeprefix("What is ").split("?")[0].split(" + "))
    assert row["answer"] == a + b
    with pytest.raises(ValueError, match="part"):
        sum_rows(4, part="test")


@pytest.mark.parametrize(
    "text, reward",
    [
        ("12", 1.0),  # only the number, right
        ("12.", 1.0),
        ("13", 0.5),  # only a number, wrong
        ("The answer is 12.", 0.5 * (1 - 3 / 8) + 0.5),  # right, 4 words
        ("5 + 7 = 13", 0.5 * (1 - 4 / 8)),  # wrong, 5 words
        ("twelve " * 12, 0.0),  # long and no number
        ("", 0.0),
    ],
)
def test_number_only_pays_half_for_brevity_and_half_for_the_right_number(text, reward):
    assert number_only([text], answer=[12]) == [pytest.approx(reward)]
    assert number_only([text], answer=[None]) == [None]  # nothing to compare against: masked

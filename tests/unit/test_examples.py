"""The shipped demo task's data and reward: a held-out split that training never draws, and a reward
in [0, 1] that pays for exactly what the prompt asks (only the number, and the right one)."""

from __future__ import annotations

import pytest

from grpoflow.examples.envs import sum_rows, sum_text_rows
from grpoflow.examples.rewards import answer_correct, answer_format, number_only

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


def test_r1_zero_rows_are_plain_text_and_hold_out_the_same_pairs():
    row = sum_text_rows(1, seed=3)[0]
    assert isinstance(row["prompt"], str) and row["prompt"].endswith("\nAnswer:")  # for a base model, as is
    a, b = (int(x) for x in row["prompt"].rsplit("What is ", 1)[1].split("?")[0].split(" + "))
    assert row["answer"] == a + b and 1 <= a <= 20 and 1 <= b <= 20
    train = {r["prompt"] for seed in range(5) for r in sum_text_rows(512, seed=seed)}
    held_out = {r["prompt"] for seed in range(5) for r in sum_text_rows(512, seed=seed, part="eval")}
    assert train and held_out and not train & held_out


@pytest.mark.parametrize(
    "text, fmt, correct",
    [
        (" 3 + 4 = 7. <answer>7</answer>", 1.0, 1.0),
        (" 3 + 4 = 8 <answer> 8 </answer>", 1.0, 0.0),  # the format without the right number
        (" 7", 0.0, 0.0),  # the right number without the tags
        ("<answer>7</answer> or <answer>8</answer>", 0.0, 1.0),  # two answers: no format; the first counts
        ("<answer>7</answer> and then more", 0.0, 1.0),  # not ending at the answer
    ],
)
def test_r1_zero_rewards_score_the_format_and_the_tagged_number_apart(text, fmt, correct):
    assert answer_format([text]) == [fmt]
    assert answer_correct([text], answer=[7]) == [correct]
    assert answer_correct([text]) == [None]  # no answer to compare with: masked, not 0

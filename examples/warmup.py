"""SFT warm-up examples for the shipped tool configs (their `warmup` section): replies that show a
model the tool-call format it otherwise never writes. Each example is a data row plus `reply`: the
assistant's text, or the messages after the prompt (assistant turns are learned, tool turns are
context)."""

from __future__ import annotations

import json
import random

from grpoflow.examples.envs import letters_rows, product_rows
from grpoflow.examples.tools import calculator


def tool_call(name: str, arguments: dict) -> str:
    """One call in the Hermes format grpoflow's default parser reads."""
    return f"<tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call>"


def calculator_replies(n: int = 128, seed: int = 1) -> list[dict]:
    """Product questions (training-split pairs, another seed than the run's data) answered the way
    configs/smollm2-tools.yaml rewards: call the calculator, then reply with the number it returned."""
    out = []
    for row in product_rows(n, seed=seed):
        expression = f"{row['a']} * {row['b']}"
        result = calculator(expression)
        reply = [
            {"role": "assistant", "content": tool_call("calculator", {"expression": expression})},
            {"role": "tool", "name": "calculator", "content": result},
            {"role": "assistant", "content": result},
        ]
        out.append({**row, "reply": reply})
    return out


def single_calls(tool: str, argument: str, values: list, n: int = 64, seed: int = 0) -> list[dict]:
    """The tiny configs' prompts (grpoflow.examples.envs:letters_rows), each answered with one call to `tool`
    with `argument` drawn from `values`: the random tiny model learns the markup, not when to call."""
    rng = random.Random(seed)
    return [
        {**row, "reply": tool_call(tool, {argument: rng.choice(values)})} for row in letters_rows(n, seed)
    ]

"""A shared prompt's two layouts, timed: one row with attention by segment (`tasks/learner/segments.py`,
what the learner runs with its LM head apart) against the repeated KV cache (what a sharded learner
runs), both through `tasks/learner/logprobs.py: shared_prompt_logprobs`.

    .venv/bin/python benchmarks/prompt_layouts.py [--size 135m] [--shapes 8x4-16 8x16 8x32 4x64 2x128 1x512]

A shape `PxC` is P prompts of `--prompt-tokens` (50) random tokens, each with `--group` (8)
completions of C tokens (`C1-C2`: uniform lengths in C1..C2), on a random model of benchmarks/learner.py's
`--size` shape, in `--dtype` (bf16 autocast over float32 weights, as the learner computes on a CPU
that has bf16). A step is one forward and backward of the completions' logprobs, the LM head apart (one
learner process), no optimizer. Per shape and layout, the median of `--repeats` steps after a warm-up,
the two layouts alternating for `--rounds` rounds. One JSON line per shape and layout: seconds and
the ratio segments / cached.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import learner as bench  # benchmarks/learner.py: model shapes, random weights


def samples_of(shape: str, prompt_tokens: int, group: int, vocab: int, seed: int = 0) -> list:
    from grpoflow.tasks.learner.learner_api import TrainSample

    prompts, lengths = shape.split("x")
    low, _, high = lengths.partition("-")
    rng = random.Random(seed)
    out = []
    for _ in range(int(prompts)):
        prompt = [rng.randrange(vocab) for _ in range(prompt_tokens)]
        for _ in range(group):
            n = rng.randint(int(low), int(high or low))
            out.append(TrainSample(prompt + [rng.randrange(vocab) for _ in range(n)], prompt_tokens,
                                   [1] * n, [-2.0] * n, rng.choice([1.0, -1.0])))  # fmt: skip
    return out


def time_layout(model, mb: list, layout: str, dtype: torch.dtype, repeats: int) -> float:
    from grpoflow.tasks.learner.logprobs import shared_prompt_logprobs

    def step() -> float:
        start = time.perf_counter()
        with torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32):
            out = shared_prompt_logprobs(model, mb, temperature=1.0, pad_id=0, device=torch.device("cpu"),
                                         layout=layout)  # fmt: skip
        (out.logprobs.float() * out.mask).sum().backward()
        model.zero_grad(set_to_none=True)
        return time.perf_counter() - start

    step()  # warm-up
    return statistics.median(step() for _ in range(repeats))


def main(argv: list[str] | None = None) -> None:
    from transformers import AutoModelForCausalLM

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="135m", choices=sorted(bench.MODEL_SHAPES))
    ap.add_argument("--shapes", nargs="+", default=["8x4-16", "8x16", "8x32", "4x64", "2x128", "1x512"])
    ap.add_argument("--prompt-tokens", type=int, default=50)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args(argv)
    dtype = getattr(torch, args.dtype)
    with tempfile.TemporaryDirectory() as tmp:
        bench.save_random_model(args.size, Path(tmp))
        model = AutoModelForCausalLM.from_pretrained(tmp, dtype=torch.float32)
    for shape in args.shapes:
        mb = samples_of(shape, args.prompt_tokens, args.group, model.config.vocab_size)
        times: dict[str, list[float]] = {"segments": [], "cached": []}
        for _ in range(args.rounds):
            for layout in times:
                times[layout].append(time_layout(model, mb, layout, dtype, args.repeats))
        seconds = {k: round(statistics.median(v), 3) for k, v in times.items()}
        for layout, secs in seconds.items():
            row = {"size": args.size, "shape": shape, "prompt_tokens": args.prompt_tokens, "group": args.group,
                   "dtype": args.dtype, "layout": layout, "seconds": secs, "rounds": times[layout],
                   "segments_over_cached": round(seconds["segments"] / seconds["cached"], 3)}  # fmt: skip
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()

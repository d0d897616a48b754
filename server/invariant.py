"""Batch-invariant linear layers for vLLM's CPU workers: a request's numbers must not follow its batch.

vLLM's CPU linear layers (oneDNN, fp32) give every row the same bits whatever the batch's row count,
except one case: a call with exactly one row (one sequence decoding alone) takes another kernel for
some shapes (SmolLM2's down projection, K=1536: the last bits of its output differ). Each kind of layer
is checked once, the first time one is processed: random rows alone against the same rows among others.
A kind is its kernel (the `cpu_linear` vLLM chose), weight shape, dtype and bias: the code a call runs
follows from those and its row count, never from the weights' values, so the verdict holds for every
layer of the kind, and a weight push's reload, which processes every layer again, checks nothing (it
did: about 0.35 s of SmolLM2's 0.6 s reload, BENCHMARKS.md, "A reload that no longer re-checks every
layer"). A layer whose single row differs is called from then on with one more row, a copy of the
first, and answers the rows it was given, so no call of it has one row; the others are left as they
are (the copy costs throughput: BENCHMARKS.md, "Reproducibility"). A kind whose rows differ at other row
counts too cannot be mended that way: it is logged as a warning, and runs on this server are not
reproducible.

vLLM's CPU attention kernel is the other place where a row's bits follow its batch. It tiles each
request's query tokens by how the call's work divides among threads, and the size of a query tile sets
the size of the KV tiles its softmax runs over: rows of a prompt prefilled beside other prompts got
other KV tiles than alone (beyond about 480 tokens on this machine), and a prompt whose prefix was
cached got other tiles than one prefilled whole. A decode (one query token) is the exception: its bits
are the same beside anything. So every request of more than `c` query tokens is handed to the kernel
as pieces of at most `c` tokens, each piece a request of its own over the same blocks, its causal end
where its last token stands (`_pieces`). Each row is then computed as a decode computes it, whatever
ran beside it and whatever of its prompt was cached. `c` is the largest of `CHUNKS` whose pieces give
the same bits as single decodes on a synthetic sequence of `CHECK_TOKENS` tokens, checked once per
attention shape (`_chunk_size`); 1 is a decode by construction. Non-causal attention is left as it is.

`install()` wraps vLLM's `dispatch_cpu_unquantized_gemm`, which sets each layer's `cpu_linear` when the
model's weights are processed (at load and after each reload), so it must run before the model loads:
`merge.py`, the worker extension every server grpoflow starts imports into its workers, calls it.
It also wraps the two CPU attention ops of `vllm._custom_ops` (the scheduler that plans a call, and the
kernel), which vLLM's CPU attention backend looks up at each call.
Runs inside vLLM's worker process: vllm and torch (the environment's own, imported inside the functions
that use them: grpoflow.server PROVIDED_BY_VLLM).
"""

from __future__ import annotations

import itertools
import logging
import os

_INSTALLED = False


ROWS = (1, 2, 3, 5, 8, 17, 64)  # row counts checked against the same rows in one call of max(ROWS) + 1
CHUNKS = (8, 4, 2)  # query tokens per piece, tried in turn; 1 (a decode) when none passes
CHECK_TOKENS = 2048  # the synthetic sequence each attention shape is checked on
_chunk_sizes: dict[tuple, int] = {}
_variants: dict[tuple, list[int]] = {}  # a kind of linear layer (the module doc) -> its `_variant_rows`


def _one_more_row(cpu_linear):
    import torch

    def linear(x, weight, bias):
        return cpu_linear(torch.cat([x, x[:1]]), weight, bias)[: x.shape[0]]

    linear.grpoflow_invariant = True
    return linear


def _variant_rows(cpu_linear, weight, bias, in_features: int, dtype) -> list[int]:
    """The row counts of ROWS at which this layer's rows differ from the same rows in a larger call."""
    import torch

    g = torch.Generator().manual_seed(0)
    x = torch.randn(max(ROWS) + 1, in_features, generator=g).to(dtype)
    with torch.no_grad():
        full = cpu_linear(x, weight, bias)
        return [m for m in ROWS if not torch.equal(cpu_linear(x[:m].contiguous(), weight, bias), full[:m])]


def _kind_variant_rows(cpu_linear, weight, bias, shape: tuple[int, int], dtype) -> list[int]:
    """`_variant_rows` of the first layer of this kind (the module doc), for every layer of it."""
    kind = (getattr(cpu_linear, "__code__", type(cpu_linear)), shape, dtype, bias is not None)
    if kind not in _variants:
        _variants[kind] = _variant_rows(cpu_linear, weight, bias, shape[1], dtype)
    return _variants[kind]


def _pieces(q_lens: list[int], seq_lens: list[int], c: int) -> tuple[list[int], list[int], list[int]]:
    """Each request as pieces of at most `c` query tokens: for every piece, the request it comes from,
    its query token count and its sequence length (the position after its last token)."""
    rows, lens, seqs = [], [], []
    for i, (q, s) in enumerate(zip(q_lens, seq_lens, strict=True)):
        for t in range(0, max(q, 1), c):
            n = min(c, q - t)
            rows.append(i)
            lens.append(n)
            seqs.append(s - q + t + n)
    return rows, lens, seqs


def _as_kwargs(signature, args, kw) -> dict:
    """A call's arguments by name. vLLM passes them all by keyword: then no binding (this runs for every
    layer at every step)."""
    if not args:
        return kw
    bound = signature.bind(*args, **kw)
    bound.apply_defaults()
    return dict(bound.arguments)


class _Attention:
    """vLLM's two CPU attention ops, wrapped: `schedule` keeps its arguments on the plan it returns (a
    tensor), and `attend` runs a causal call whose requests have more than `c` query tokens as pieces
    (planned once per schedule: every layer of a step shares it)."""

    def __init__(self, schedule_op, attend_op):
        import inspect

        self.schedule_op, self.attend_op = schedule_op, attend_op
        self.signatures = inspect.signature(schedule_op), inspect.signature(attend_op)

    def schedule(self, *args, **kw):
        kw = _as_kwargs(self.signatures[0], args, kw)
        kw["enable_kv_split"] = False  # a KV split follows the batch too (VLLM_CPU_ATTN_SPLIT_KV)
        plan = self.schedule_op(**kw)
        plan.grpoflow_schedule = kw
        return plan

    def attend(self, *args, **kw):
        kw = _as_kwargs(self.signatures[1], args, kw)
        plan = kw["scheduler_metadata"]
        pieces = getattr(plan, "grpoflow_pieces", None)
        if pieces is None:
            pieces = plan.grpoflow_pieces = self._plan(getattr(plan, "grpoflow_schedule", None), kw)
        return self.attend_op(**{**kw, **pieces})

    def _plan(self, sched: dict | None, kw: dict) -> dict:
        """The call's arguments that change when its requests are cut into pieces ({} when none is)."""
        import torch

        if sched is None or not kw.get("causal", True) or kw.get("dynamic_causal") is not None:
            return {}
        n = sched["num_reqs"]
        starts = kw["query_start_loc"][: n + 1].tolist()
        q_lens = [b - a for a, b in itertools.pairwise(starts)]
        c = self._chunk_size(sched, kw)
        if max(q_lens, default=0) <= c:
            return {}
        rows, lens, seqs = _pieces(q_lens, kw["seq_lens"][:n].tolist(), c)
        qsl = torch.tensor([0, *lens], dtype=torch.int32).cumsum(0, dtype=torch.int32)
        seq = torch.tensor(seqs, dtype=torch.int32)
        plan = self.schedule_op(**{**sched, "num_reqs": len(rows), "seq_lens": seq, "query_start_loc": qsl})
        table = kw["block_table"].index_select(0, torch.tensor(rows))
        return {"query_start_loc": qsl, "seq_lens": seq, "block_table": table, "scheduler_metadata": plan}

    def _chunk_size(self, sched: dict, kw: dict) -> int:
        """The largest of CHUNKS whose pieces compute rows as decodes do, for this call's shape."""
        block_size = kw["key_cache"].shape[2]
        key = (
            *(
                sched.get(k)
                for k in ("num_heads", "num_kv_heads", "head_dim", "dtype", "isa", "kv_cache_dtype")
            ),
            sched.get("sliding_window_size"),
            kw.get("softcap"),
            kw.get("alibi_slopes") is not None,
            kw.get("s_aux") is not None,
            block_size,
        )
        if key not in _chunk_sizes:
            # fp8 caches are not checked: one token a piece
            fits = sched.get("kv_cache_dtype", "auto") == "auto"
            _chunk_sizes[key] = next((c for c in CHUNKS if fits and self._like_decodes(sched, kw, c)), 1)
        return _chunk_sizes[key]

    def _like_decodes(self, sched: dict, kw: dict, c: int) -> bool:
        """On a random sequence of CHECK_TOKENS tokens: do rows computed in pieces of `c`, starting at
        several points (a prompt whose prefix was cached), have the bits of the rows decoded one by one?"""
        import torch

        n, dim, block_size = CHECK_TOKENS, sched["head_dim"], kw["key_cache"].shape[2]
        g = torch.Generator().manual_seed(0)
        blocks = -(-n // block_size)
        cache = torch.randn(blocks, sched["num_kv_heads"], 2 * block_size, dim, generator=g)
        keys, values = cache.to(sched["dtype"]).chunk(2, dim=2)  # as vLLM's CPU backend views its cache
        query = torch.randn(n, sched["num_heads"], dim, generator=g).to(sched["dtype"])

        def rows(first: int, c: int):  # rows first..n-1 of one request: its first `first` tokens cached
            _, lens, seqs = _pieces([n - first], [n], c)
            qsl = torch.tensor([0, *lens], dtype=torch.int32).cumsum(0, dtype=torch.int32)
            seq = torch.tensor(seqs, dtype=torch.int32)
            plan = self.schedule_op(
                **{**sched, "num_reqs": len(lens), "seq_lens": seq, "query_start_loc": qsl}
            )
            out = torch.empty_like(query[first:])
            table = torch.arange(blocks, dtype=torch.int32).expand(len(lens), -1).contiguous()
            self.attend_op(
                **{
                    **kw,
                    "query": query[first:],
                    "key_cache": keys,
                    "value_cache": values,
                    "output": out,
                    "query_start_loc": qsl,
                    "seq_lens": seq,
                    "block_table": table,
                    "scheduler_metadata": plan,
                }
            )
            return out

        decoded = rows(0, 1)
        return all(
            torch.equal(rows(first, c), decoded[first:]) for first in (0, 1, c - 1, n // 3, n - 2 * c - 1)
        )


def install() -> None:
    """Wrap every CPU linear layer vLLM builds from now on (a no-op off CPU, when done already, and with
    GRPOFLOW_BATCH_INVARIANT=0 in the server's environment: the speed without the copy, measured in
    BENCHMARKS.md, "Reproducibility")."""
    global _INSTALLED
    if _INSTALLED or os.environ.get("GRPOFLOW_BATCH_INVARIANT", "1") == "0":
        return
    from vllm.model_executor.layers import utils
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    dispatch = utils.dispatch_cpu_unquantized_gemm

    def dispatch_invariant(layer, remove_weight: bool) -> None:
        weight = layer.weight  # before dispatch, which may swap it for an empty one (the kernel holds it)
        dispatch(layer, remove_weight)
        inner = getattr(layer, "cpu_linear", None)
        if inner is None or weight.is_meta or weight.ndim != 2 or getattr(inner, "grpoflow_invariant", False):
            return
        shape = tuple(weight.shape)
        variant = _kind_variant_rows(inner, layer.weight, getattr(layer, "bias", None), shape, weight.dtype)
        if variant == [1]:
            layer.cpu_linear = _one_more_row(inner)
        elif variant:
            logging.getLogger(__name__).warning(
                "linear layer %s: its rows differ at %s rows against the same rows in a larger call; "
                "runs on this server are not reproducible bit for bit",
                shape,
                variant,
            )

    utils.dispatch_cpu_unquantized_gemm = dispatch_invariant
    from vllm import _custom_ops as ops

    if hasattr(ops, "cpu_attn_get_scheduler_metadata") and hasattr(ops, "cpu_attention_with_kv_cache"):
        attention = _Attention(ops.cpu_attn_get_scheduler_metadata, ops.cpu_attention_with_kv_cache)
        ops.cpu_attn_get_scheduler_metadata = attention.schedule
        ops.cpu_attention_with_kv_cache = attention.attend
    _INSTALLED = True

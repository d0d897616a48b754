"""Batch-invariant linear layers for vLLM's CPU workers: a request's numbers must not follow its batch.

vLLM's CPU linear layers (oneDNN, fp32) give every row the same bits whatever the batch's row count,
except one case: a call with exactly one row (one sequence decoding alone) takes another kernel for
some shapes (SmolLM2's down projection, K=1536: the last bits of its output differ). Each layer is
checked once as its weights are processed: one random row alone against the same row among others.
A layer whose single row differs is called from then on with one more row, a copy of the first, and
answers the rows it was given, so no call of it has one row; the others are left as they are (the copy
costs throughput: BENCHMARKS.md, "Reproducibility"). A layer whose rows differ at other row counts too
cannot be mended that way: it is logged as a warning, and runs on this server are not reproducible.

`install()` wraps vLLM's `dispatch_cpu_unquantized_gemm`, which sets each layer's `cpu_linear` when the
model's weights are processed (at load and after each reload), so it must run before the model loads:
`grpoflow_merge`, the worker extension every server grpoflow starts imports into its workers, calls it.
Runs inside vLLM's worker process: imports only vLLM and torch.
"""

from __future__ import annotations

import logging
import os

_INSTALLED = False


ROWS = (1, 2, 3, 5, 8, 17, 64)  # row counts checked against the same rows in one call of max(ROWS) + 1


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
        variant = _variant_rows(
            inner, layer.weight, getattr(layer, "bias", None), weight.shape[1], weight.dtype
        )
        shape = tuple(weight.shape)
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
    _INSTALLED = True

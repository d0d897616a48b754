"""Batch-invariant linear layers for vLLM's CPU workers: a request's numbers must not follow its batch.

vLLM's CPU linear layers (oneDNN, fp32) give every row the same bits whatever the batch's row count,
except one: a batch of exactly one token (one sequence decoding alone) takes another kernel for some
shapes (SmolLM2's down projection, K=1536: the last bits of its output differ). So every CPU linear
layer is called with one more row, a copy of the first, and answers the rows it was given: no call
has one row. Decode batches of one are rare and small; the copy costs a row per call.

`install()` wraps vLLM's `dispatch_cpu_unquantized_gemm`, which sets each layer's `cpu_linear` when the
model's weights are processed (at load and after each reload), so it must run before the model loads:
`grpoflow_merge`, the worker extension every server grpoflow starts imports into its workers, calls it.
Runs inside vLLM's worker process: imports only vLLM and torch.
"""

from __future__ import annotations

import os

_INSTALLED = False


def _one_more_row(cpu_linear):
    import torch

    def linear(x, weight, bias):
        return cpu_linear(torch.cat([x, x[:1]]), weight, bias)[: x.shape[0]]

    linear.grpoflow_invariant = True
    return linear


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
        dispatch(layer, remove_weight)
        inner = getattr(layer, "cpu_linear", None)
        if inner is not None and not getattr(inner, "grpoflow_invariant", False):
            layer.cpu_linear = _one_more_row(inner)

    utils.dispatch_cpu_unquantized_gemm = dispatch_invariant
    _INSTALLED = True

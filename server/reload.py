"""Weight reloads on a CPU server that write the new values into plain weights and pack them again,
instead of vLLM's generic reload (issue 59: pushes that cost what changed).

vLLM's CPU linear layers multiply by a copy of their weight packed for oneDNN (or sgl-kernel), made when
the layer's weights are processed, and then drop the plain weight. Its `reload_weights` therefore
rebuilds every layer: it puts each layer's parameters back on the meta device, allocates them again,
buffers every tensor a layer loads until the layer is complete, processes it (packing again) and copies
the results into the tensors the model held.

`install()` wraps vLLM's `dispatch_cpu_unquantized_gemm` (where every CPU linear layer, embedding and LM
head is packed, at load and after each reload) to keep the Parameter each layer's kernel was packed from,
the one vLLM's loaders write into (its `weight_loader` and shard attributes), with its storage freed when
vLLM drops it. `reload(model, weights)` gives those Parameters storage again, puts them back on their
layers, lets the model's own `load_weights` copy the new tensors into them (its name mapping, fused
q/k/v and gate/up shards, tied embeddings: nothing is reimplemented here), packs again, through the same
dispatch, each layer whose weight it wrote (so grpoflow's batch-invariant kernels, invariant.py, are
chosen as at load), and frees the storage. Every other parameter (norms, embeddings) is loaded in place,
as vLLM's own loader does, and each layer ends with the very Parameter objects it had before, as after
vLLM's reload. An embedding that is not an LM head is not packed again: it looks rows up in its weight,
and vLLM never calls the pack it makes of it. A SmolLM2-135M push's pause/reload/resume took 0.35 s
against vLLM's 0.45 s in float32, 0.19 s against 0.28 s in bf16, most of it packing (BENCHMARKS.md,
"Reloads that pack what they wrote").

While it runs, a reload holds the plain weights of every layer at once (vLLM's holds a layer's); a
layer's weights must come whole, as a version's file or merge.py's merged modules give them (a fused
layer given in part would be packed from memory never written, as vLLM's reload would). The weights given
may be some of the model's: a layer not written keeps what it served. `GRPOFLOW_PLAIN_RELOAD=0` in the
server's environment turns this off (vLLM's reload runs); so do a server off CPU and a quantized model
(`can_reload` answers False).

A reload that fails partway (a tensor whose shape does not fit) leaves every pack as it was, with some
norms or embeddings new: the push then rolls the server back by reloading the previous version
(tasks/push/push.py), which rewrites and repacks everything.

Runs inside vLLM's worker process: vllm and torch (the environment's own, imported inside the functions
that use them: grpoflow.server PROVIDED_BY_VLLM).
"""

from __future__ import annotations

import os
import weakref

from grpoflow.server.protocol import PLAIN_RELOAD_ENV as ENV

# layer -> (the Parameter its kernel was packed from, the shape it had: None when vLLM keeps it live)
_plain: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_INSTALLED = False


def install() -> None:
    """Keep every CPU layer's packed-from Parameter from now on (the module doc). Call before the model
    loads and after invariant.install(), so that packing here goes through its wrapper too."""
    global _INSTALLED
    if _INSTALLED or os.environ.get(ENV, "1") == "0":
        return
    import torch
    from vllm.model_executor.layers import utils
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    dispatch = utils.dispatch_cpu_unquantized_gemm

    def dispatch_keeping(layer, remove_weight: bool) -> None:
        weight = layer.weight  # before dispatch, which may swap it for an empty one
        dispatch(layer, remove_weight)
        if weight.is_meta or weight.ndim != 2:
            return
        shape = None
        if layer.weight is not weight:  # dropped: its storage goes, the Parameter (and its loader) stays
            shape = weight.shape
            weight.data = torch.empty(0, dtype=weight.dtype)
        _plain[layer] = (weight, shape)

    utils.dispatch_cpu_unquantized_gemm = dispatch_keeping
    _INSTALLED = True


def can_reload(model, vllm_config) -> bool:
    """Does `reload` apply to this model: a CPU model whose packed layers were recorded, not quantized."""
    if not _INSTALLED or vllm_config.model_config.quantization:
        return False
    return any(m in _plain for m in model.modules())


def reload(model, weights) -> int:
    """Load `weights` ((name, tensor) pairs in the checkpoint's names; all of the model's, or some) into
    `model` and pack again the layers whose weights were written (the module doc); how many."""
    import torch
    from vllm.model_executor.layers import utils

    # A weight vLLM keeps live is taken from the layer: after vLLM's own reload the Parameter recorded is
    # the one it loaded into and copied from, not the one the layer holds.
    layers = [
        (m, m.weight if shape is None else plain, shape)
        for m in model.modules()
        if m in _plain and not _lookup_only(m)
        for plain, shape in [_plain[m]]
    ]
    held = {m: m.weight for m, _, _ in layers}  # what each layer holds now (an empty one: dropped)
    with torch.no_grad():
        try:
            for m, plain, shape in layers:
                if shape is not None:
                    plain.data = torch.empty(shape, dtype=plain.dtype)
                    m.weight = plain  # nn.Module registers it as the layer's `weight` again
            loaded = model.load_weights(weights)
            params = dict(model.named_parameters())  # a tied head's weight under its embedding's name
            # every layer, when the model does not say what it wrote in names it has (LoRA's wrappers)
            known = loaded is not None and all(n in params for n in loaded)
            written = {id(params[n]) for n in loaded} if known else None
            packed = [(m, shape) for m, plain, shape in layers if written is None or id(plain) in written]
            for m, shape in packed:
                utils.dispatch_cpu_unquantized_gemm(m, shape is not None)  # records the same Parameter
        finally:
            for m, weight in held.items():
                m.weight = weight
            for _, plain, shape in layers:
                if shape is not None:
                    plain.data = torch.empty(0, dtype=plain.dtype)
    return len(packed)


def _lookup_only(layer) -> bool:
    """An embedding that is not an LM head: vLLM packs it as it packs a head, and never calls that pack."""
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding

    return isinstance(layer, VocabParallelEmbedding) and not isinstance(layer, ParallelLMHead)

"""grpoflow.server.reload (run inside vLLM's CPU workers): which layers a reload writes and packs again,
and what each layer holds afterwards, with a stand-in model and a stand-in for vLLM's packing (vLLM's
modules import only in its own environment). The real server's bits after such a reload against after
vLLM's own are tests/integration/test_weight_push.py's."""

from __future__ import annotations

import sys
import types

import pytest
import torch
from torch import nn


def _dispatch(layer, remove_weight: bool) -> None:
    """A stand-in for vLLM's `dispatch_cpu_unquantized_gemm`: the kernel multiplies by a copy of the
    weight made now, and the plain weight is dropped when asked (as vLLM does for linear layers)."""
    layer.pack = layer.weight.detach().clone()
    layer.packs = getattr(layer, "packs", 0) + 1
    if remove_weight:
        layer.weight = nn.Parameter(torch.empty(0), requires_grad=False)


class _Layer(nn.Module):
    def __init__(self, rows: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(rows, 4), requires_grad=False)


class _Embedding(_Layer):
    """Stands in for vLLM's VocabParallelEmbedding: packed at load (remove_weight False), used by lookup."""


class _Head(_Embedding):
    """Stands in for vLLM's ParallelLMHead; tied: its weight is the embedding's Parameter."""


class _Model(nn.Module):
    """A fused q/k/v layer loaded by shards (as vLLM's QKVParallelLinear), a plain one, a norm that is
    never packed, and an embedding with its tied head; `load_weights` answers the parameters it wrote
    (a tied head's under the embedding's name), as vLLM's models do."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv, self.o = _Layer(6), _Layer(4)
        self.norm = nn.Parameter(torch.ones(4), requires_grad=False)
        self.embed, self.head = _Embedding(3), _Head(3)
        self.head.weight = self.embed.weight

    def load_weights(self, weights) -> set[str]:
        loaded = set()
        for name, t in weights:
            if name in ("q", "k", "v"):
                i = "qkv".index(name)
                self.qkv.weight[2 * i : 2 * i + 2].copy_(t)
                loaded.add("qkv.weight")
            else:
                self.get_parameter(name).copy_(t)
                loaded.add(name)
        return loaded


@pytest.fixture
def plain(monkeypatch):
    """grpoflow.server.reload installed over the stand-ins, and a model loaded through them."""
    utils = types.SimpleNamespace(dispatch_cpu_unquantized_gemm=_dispatch)
    platforms = types.SimpleNamespace(current_platform=types.SimpleNamespace(is_cpu=lambda: True))
    embedding = types.SimpleNamespace(VocabParallelEmbedding=_Embedding, ParallelLMHead=_Head)
    layers = types.SimpleNamespace(utils=utils, vocab_parallel_embedding=embedding)
    for name, module in {
        "vllm": types.SimpleNamespace(),
        "vllm.model_executor": types.SimpleNamespace(layers=layers),
        "vllm.model_executor.layers": layers,
        "vllm.model_executor.layers.utils": utils,
        "vllm.model_executor.layers.vocab_parallel_embedding": embedding,
        "vllm.platforms": platforms,
    }.items():
        monkeypatch.setitem(sys.modules, name, module)
    from grpoflow.server import reload

    monkeypatch.setattr(reload, "_INSTALLED", False)
    monkeypatch.setattr(reload, "_plain", type(reload._plain)())
    monkeypatch.delenv(reload.ENV, raising=False)
    reload.install()
    model = _Model()
    model.load_weights([("q", torch.full((2, 4), 1.0)), ("k", torch.full((2, 4), 2.0)),
                        ("v", torch.full((2, 4), 3.0)), ("o.weight", torch.full((4, 4), 4.0)),
                        ("embed.weight", torch.full((3, 4), 0.5))])  # fmt: skip
    for layer in (model.qkv, model.o):  # the model's load: each layer processed once
        utils.dispatch_cpu_unquantized_gemm(layer, True)
    for layer in (model.embed, model.head):
        utils.dispatch_cpu_unquantized_gemm(layer, False)
    return reload, model


NEW = [("q", torch.full((2, 4), 5.0)), ("k", torch.full((2, 4), 6.0)), ("v", torch.full((2, 4), 7.0)),
       ("o.weight", torch.full((4, 4), 8.0)), ("norm", torch.full((4,), 9.0)),
       ("embed.weight", torch.full((3, 4), 1.5))]  # fmt: skip


def test_a_reload_writes_plain_weights_and_packs_every_layer_it_wrote_but_lookups(plain):
    reload, model = plain
    empties = model.qkv.weight, model.o.weight
    assert [e.numel() for e in empties] == [0, 0]  # dropped at load, as vLLM drops them
    assert reload._plain[model.qkv][0].numel() == 0  # kept without its storage
    assert reload.reload(model, NEW) == 3  # qkv, o and the head; the embedding only looks rows up
    assert model.qkv.pack[:, 0].tolist() == [5, 5, 6, 6, 7, 7] and bool((model.o.pack == 8).all())
    assert bool((model.head.pack == 1.5).all()) and model.embed.packs == 1
    assert bool((model.norm == 9).all()) and bool((model.embed.weight == 1.5).all())
    assert (model.qkv.weight, model.o.weight) == empties  # the very Parameters held before
    assert model.head.weight is model.embed.weight
    assert [n for n, _ in model.named_parameters()] == ["norm", "qkv.weight", "o.weight", "embed.weight"]
    assert reload._plain[model.qkv][0].numel() == 0  # the storage freed again


def test_a_reload_of_some_layers_packs_only_those_and_the_others_serve_what_they_did(plain):
    reload, model = plain
    assert reload.reload(model, [("o.weight", torch.full((4, 4), 8.0))]) == 1
    assert model.qkv.packs == 1 and model.head.packs == 1 and model.o.packs == 2
    assert model.qkv.pack[:, 0].tolist() == [1, 1, 2, 2, 3, 3] and bool((model.o.pack == 8).all())


def test_a_reload_that_fails_leaves_the_packs_served_and_the_layers_as_they_were(plain):
    reload, model = plain
    empties = model.qkv.weight, model.o.weight
    with pytest.raises(RuntimeError):  # a tensor whose shape does not fit its weight
        reload.reload(model, [*NEW[:3], ("o.weight", torch.zeros(3, 3))])
    assert (model.qkv.weight, model.o.weight) == empties
    assert model.qkv.packs == model.o.packs == 1
    assert model.qkv.pack[:, 0].tolist() == [1, 1, 2, 2, 3, 3]
    assert reload._plain[model.qkv][0].numel() == 0
    # the push's rollback reloads a whole version: everything written and packed again
    assert reload.reload(model, NEW) == 3 and model.qkv.pack[:, 0].tolist() == [5, 5, 6, 6, 7, 7]


def test_no_plain_weight_is_kept_when_the_server_says_so(plain, monkeypatch):
    reload, _ = plain
    monkeypatch.setattr(reload, "_INSTALLED", False)
    monkeypatch.setenv(reload.ENV, "0")
    reload.install()
    assert reload._INSTALLED is False


def test_after_vllms_own_reload_a_live_weight_is_packed_from_what_the_layer_holds(plain):
    reload, model = plain
    # vLLM's reload processes a layer in a copy of its parameters, then copies them back: the Parameter
    # recorded for the head is that copy, not the embedding's the head multiplies by.
    reload._plain[model.head] = (nn.Parameter(model.embed.weight.detach().clone(), requires_grad=False), None)
    assert reload.reload(model, NEW) == 3
    assert bool((model.head.pack == 1.5).all())  # the new embedding, packed

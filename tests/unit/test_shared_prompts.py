"""A shared prompt's two layouts: one row of tokens with attention by segment (the prompts, then each
completion over its prompt and itself: one forward, no padding in the decoder's layers), or its KV cache
row repeated for its completions (two forwards; the whole model, for a sharded learner or a model whose
head cannot run apart). Both give the padded full-sequence forward's logprobs and gradients, for Llama,
Gemma 3 (a sliding window on some layers, counted in positions) and Mistral (one on every layer), with
attention as matrix products and, past `MATRIX_PAIRS`, in torch's fused kernel."""

from __future__ import annotations

import pytest
import torch

import grpoflow.tasks.learner.segments as segs
from grpoflow.tasks.learner.learner_api import TrainSample
from grpoflow.tasks.learner.logprobs import padded_logprobs, prompt_rows, shared_prompt_logprobs, split_head
from tests.support import make_learner
from tests.support import train_samples as samples

pytestmark = pytest.mark.unit
CPU = torch.device("cpu")


def batch() -> list[TrainSample]:
    """Prompts of lengths 3 (two completions), 2 and 5 (two completions): sequences of 5-8 tokens,
    longer than the random models' sliding window of 4."""
    return [
        *samples(),
        TrainSample([11, 12, 13, 14, 15, 60, 61, 62], 5, [1, 1, 1], [-5.5] * 3, -0.5),
        TrainSample([11, 12, 13, 14, 15, 63], 5, [1], [-5.5], 0.25),
    ]


def random_model(arch: str, tiny_model_dir, window: int = 4):
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig, MistralConfig, MistralForCausalLM

    torch.manual_seed(0)
    shape = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                 num_attention_heads=2, num_key_value_heads=1, head_dim=16, sliding_window=window,
                 max_position_embeddings=64)  # fmt: skip
    if arch == "gemma3":  # sliding-window and full layers
        return Gemma3ForCausalLM(Gemma3TextConfig(**shape)).float()
    if arch == "mistral":  # every layer windowed
        return MistralForCausalLM(MistralConfig(**shape)).float()
    return make_learner(tiny_model_dir, total_steps=1).model


def forward_calls(module) -> list[int]:
    calls = [0]
    module.register_forward_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    return calls


@pytest.mark.parametrize("arch", ["tiny", "gemma3", "mistral"])
@pytest.mark.parametrize("fused", [False, True])
def test_segments_and_the_cache_give_the_padded_forwards_numbers(tiny_model_dir, arch, fused, monkeypatch):
    if fused:  # every attention call in torch's fused kernel
        monkeypatch.setattr(segs, "MATRIX_PAIRS", 0)
    model = random_model(arch, tiny_model_dir)
    calls = forward_calls(split_head(model).decoder)
    out = {}
    for name, forward in (
        ("padded", padded_logprobs),
        ("segments", shared_prompt_logprobs),
        ("cached", lambda *a, **k: shared_prompt_logprobs(*a, layout="cached", **k)),
    ):
        model.zero_grad()
        before = calls[0]
        mb = forward(model, batch(), temperature=0.7, pad_id=0, device=CPU)
        (mb.logprobs * mb.mask).sum().backward()
        grads = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
        out[name] = (mb.logprobs.detach() * mb.mask, grads, calls[0] - before)
    assert [out[n][2] for n in ("padded", "segments", "cached")] == [1, 1, 2]  # forwards of the decoder
    for name in ("segments", "cached"):
        assert torch.allclose(out[name][0], out["padded"][0], atol=1e-6), name
        assert torch.allclose(out[name][1], out["padded"][1], rtol=1e-4, atol=1e-5), name
    assert model.config._attn_implementation == "sdpa"  # put back after the segments' forward


@pytest.mark.parametrize("fused", [False, True])
def test_a_window_shorter_than_a_sequence_changes_the_numbers(tiny_model_dir, fused, monkeypatch):
    # The window is applied: Gemma 3 with a window of 4 differs from the same weights with 64 (sequences
    # of up to 8 tokens), so the test above would see segments that ignored it.
    if fused:
        monkeypatch.setattr(segs, "MATRIX_PAIRS", 0)
    kw = {"temperature": 1.0, "pad_id": 0, "device": CPU}
    with torch.no_grad():
        narrow, wide = (
            shared_prompt_logprobs(random_model("gemma3", tiny_model_dir, window=w), batch(), **kw).logprobs
            for w in (4, 64)
        )
    assert not torch.allclose(narrow, wide, atol=1e-4)


def test_segments_hold_each_prompt_then_its_completions():
    mb = [
        TrainSample([5, 6, 7, 70, 71, 72], 3, [1, 1, 1], [-1.0] * 3, 1.0),
        TrainSample([5, 6, 7, 80, 81], 3, [1, 1], [-1.0] * 2, 1.0),
        TrainSample([9, 8, 90], 2, [1], [-1.0], 1.0),
        TrainSample([9, 8], 2, [], [], 1.0),  # an empty completion takes no token
    ]
    which, prompts = prompt_rows(mb)
    s = segs.segments(mb, which, prompts)
    assert s.ids.tolist() == [[5, 6, 7, 70, 71, 72, 80, 81, 9, 8, 90]]
    assert s.positions.tolist() == [[0, 1, 2, 3, 4, 5, 3, 4, 0, 1, 2]]
    assert s.prompt.tolist() == [[0, 1, 2], [8, 9, 0]]
    assert s.query[1].tolist() == [6, 7, 0] and s.query[2].tolist() == [10, 0, 0]
    # sample 1 attends to its prompt (row 0: indices 0-2), then to itself (6, 7)
    assert s.key[1].tolist() == [0, 1, 2, 6, 7, 0] and s.key_pos[1].tolist() == [0, 1, 2, 3, 4, -1]
    assert s.key_pos[2].tolist() == [0, 1, -1, 2, -1, -1]  # a shorter prompt's padding: never attended
    # sample 1's tokens 80, 81 are predicted by the prompt's last state (2), then by 80 (6)
    assert s.row[1, :2].tolist() == [2, 6] and s.row[2, :1].tolist() == [9]
    # the row's token n is the prompts' output r*P+j or the completions' 2*P + g*C+i
    assert s.back.tolist() == [0, 1, 2, 6, 7, 8, 9, 10, 3, 4, 12]


def test_auto_runs_segments_with_the_head_apart_and_the_cache_without(tiny_model_dir):
    model = make_learner(tiny_model_dir, total_steps=1).model
    calls = forward_calls(split_head(model).decoder)
    kw = {"temperature": 1.0, "pad_id": 0, "device": CPU}
    with torch.no_grad():
        apart = shared_prompt_logprobs(model, batch(), **kw)
        assert calls[0] == 1
        whole = shared_prompt_logprobs(model, batch(), head_apart=False, **kw)  # a sharded learner's
        assert calls[0] == 3
    assert torch.allclose(apart.logprobs * apart.mask, whole.logprobs * whole.mask, atol=1e-6)


def test_the_segments_attention_runs_only_inside_their_forward():
    q = torch.zeros(1, 2, 3, 4)
    with pytest.raises(ValueError, match="segment_hidden"):
        segs.segment_attention(None, q, q, q, None)


def test_the_layouts_benchmark_times_both(capsys):
    import importlib.util
    import json

    from tests.support import REPO

    spec = importlib.util.spec_from_file_location("prompt_layouts", REPO / "benchmarks" / "prompt_layouts.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    bench.main(["--size", "tiny", "--shapes", "2x2-6", "1x30", "--repeats", "1", "--rounds", "1"])
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [(r["shape"], r["layout"]) for r in rows] == [
        ("2x2-6", "segments"), ("2x2-6", "cached"), ("1x30", "segments"), ("1x30", "cached")
    ]  # fmt: skip
    assert all(r["seconds"] > 0 and r["segments_over_cached"] > 0 for r in rows)

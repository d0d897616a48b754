"""A shared prompt's two layouts: its completions packed after it in one row behind a block mask (one
forward, no padding between completions), or its KV cache row repeated for its completions (two
forwards). Both give the padded full-sequence forward's logprobs and gradients, for Llama, Gemma 3 (a
mask per layer type, its sliding window counted in positions) and Mistral (one windowed mask); "auto"
packs short completions and caches long ones, by the estimated FLOPs."""

from __future__ import annotations

import pytest
import torch

from grpoflow.tasks.learner.learner_api import TrainSample
from grpoflow.tasks.learner.logprobs import (
    packed_is_cheaper,
    packed_rows,
    padded_logprobs,
    shared_prompt_logprobs,
    split_head,
)
from tests.support import make_learner
from tests.support import train_samples as samples

pytestmark = pytest.mark.unit


def batch() -> list[TrainSample]:
    """Prompts of lengths 3 (two completions), 2 and 5 (two completions): packed rows of 8, 6 and 9
    tokens, longer than the random models' sliding window of 4."""
    return [
        *samples(),
        TrainSample([11, 12, 13, 14, 15, 60, 61, 62], 5, [1, 1, 1], [-5.5] * 3, -0.5),
        TrainSample([11, 12, 13, 14, 15, 63], 5, [1], [-5.5], 0.25),
    ]


def random_model(arch: str, tiny_model_dir):
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig, MistralConfig, MistralForCausalLM

    torch.manual_seed(0)
    shape = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                 num_attention_heads=2, num_key_value_heads=1, head_dim=16, sliding_window=4,
                 max_position_embeddings=64)  # fmt: skip
    if arch == "gemma3":  # sliding-window and full layers: one mask per layer type
        return Gemma3ForCausalLM(Gemma3TextConfig(**shape)).float()
    if arch == "mistral":  # every layer windowed: one mask
        return MistralForCausalLM(MistralConfig(**shape)).float()
    return make_learner(tiny_model_dir, total_steps=1).model


def decoder_calls(model) -> list[int]:
    calls = [0]
    split_head(model).decoder.register_forward_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    return calls


@pytest.mark.parametrize("arch", ["tiny", "gemma3", "mistral"])
def test_packed_rows_and_the_cache_give_the_padded_forwards_numbers(tiny_model_dir, arch):
    model = random_model(arch, tiny_model_dir)
    calls = decoder_calls(model)
    out = {}
    for name, forward in (
        ("padded", padded_logprobs),
        ("packed", lambda *a, **k: shared_prompt_logprobs(*a, layout="packed", **k)),
        ("cached", lambda *a, **k: shared_prompt_logprobs(*a, layout="cached", **k)),
    ):
        model.zero_grad()
        before = calls[0]
        mb = forward(model, batch(), temperature=0.7, pad_id=0, device=torch.device("cpu"))
        (mb.logprobs * mb.mask).sum().backward()
        grads = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
        out[name] = (mb.logprobs.detach() * mb.mask, grads, calls[0] - before)
    assert [out[n][2] for n in ("padded", "packed", "cached")] == [1, 1, 2]  # forwards of the decoder
    for name in ("packed", "cached"):
        assert torch.allclose(out[name][0], out["padded"][0], atol=1e-6), name
        assert torch.allclose(out[name][1], out["padded"][1], rtol=1e-4, atol=1e-5), name


def test_a_window_shorter_than_the_rows_changes_the_numbers(tiny_model_dir):
    # The window is applied: Gemma 3 with a window of 4 differs from the same weights with 64 (rows
    # of 9 tokens), so the test above would see a packed mask that ignored it.
    model = random_model("gemma3", tiny_model_dir)
    kw = {"temperature": 1.0, "pad_id": 0, "device": torch.device("cpu"), "layout": "packed"}
    with torch.no_grad():
        narrow = shared_prompt_logprobs(model, batch(), **kw).logprobs
        model.config.sliding_window = 64
        wide = shared_prompt_logprobs(model, batch(), **kw).logprobs
    assert not torch.allclose(narrow, wide, atol=1e-4)


def test_packed_rows_hold_each_prompt_then_its_completions(tiny_model_dir):
    mb = batch()
    rows = packed_rows(mb, [0, 0, 1, 2, 2], 3)
    assert rows.ids[0].tolist() == [5, 6, 7, 70, 71, 72, 80, 81, 0]
    assert rows.positions[0].tolist() == [0, 1, 2, 3, 4, 5, 3, 4, 0]
    assert rows.segment[2].tolist() == [0, 0, 0, 0, 0, 1, 1, 1, 2]
    # sample 1's tokens 80, 81 are predicted by the prompt's last state (index 2), then by 80 (index 6)
    assert rows.row[1, :2].tolist() == [0, 0] and rows.col[1, :2].tolist() == [2, 6]
    assert rows.row[4, :1].tolist() == [2] and rows.col[4, :1].tolist() == [4]


def group(prompt: int, completion: int, n: int = 8) -> list[TrainSample]:
    ids = list(range(1, prompt + 1))
    return [TrainSample(ids + [7] * completion, prompt, [1] * completion, [-1.0] * completion, 1.0)] * n


@pytest.mark.parametrize("completion, packed", [(4, True), (16, True), (1024, False)])
def test_auto_packs_short_completions_and_caches_long_ones(tiny_model_dir, completion, packed):
    # SmolLM2's demo (a ~50-token prompt, 8 completions of up to 16 tokens) packs; 8 completions of
    # 1024 tokens would make a packed row of 8k tokens whose dense attention costs more than the
    # repeated cache's, and take the cache. The estimate, then the forwards the layout runs.
    model = make_learner(tiny_model_dir, total_steps=1).model
    mb = group(50, completion)
    assert packed_is_cheaper(split_head(model).decoder, mb, [0] * len(mb)) is packed
    if completion > 100:
        return  # the estimate is what is asserted: a tiny model's 8k-token rows are not run here
    calls = decoder_calls(model)
    with torch.no_grad():
        shared_prompt_logprobs(model, mb, temperature=1.0, pad_id=0, device=torch.device("cpu"))
    assert calls[0] == (1 if packed else 2)


def test_the_layouts_benchmark_times_both_and_names_the_one_auto_takes(capsys):
    import importlib.util
    import json

    from tests.support import REPO

    spec = importlib.util.spec_from_file_location("prompt_layouts", REPO / "benchmarks" / "prompt_layouts.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    bench.main(["--size", "tiny", "--shapes", "2x2-6", "1x300", "--repeats", "1", "--rounds", "1"])
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [(r["shape"], r["layout"]) for r in rows] == [
        ("2x2-6", "packed"), ("2x2-6", "cached"), ("1x300", "packed"), ("1x300", "cached")
    ]  # fmt: skip
    assert all(r["seconds"] > 0 for r in rows)
    assert [r["auto"] for r in rows[::2]] == ["packed", "cached"]
    assert all((r["auto"] == "packed") == (r["estimate_packed_over_cached"] <= 1) for r in rows)

"""The LM head apart from the decoder: on completion tokens only (padding costs no head), and with
`learner.lm_head_chunk` a few positions at a time, each chunk's logits recomputed in the backward. The
same logprobs, loss and gradients as the whole model's forward (the eager float32 reference), in the
padded and the shared-prompt forward, for full fine-tuning and LoRA, Llama and Gemma 3 (its logit
softcap); no head call ever sees more than a chunk's positions."""

from __future__ import annotations

import pytest
import torch

from grpoflow.tasks.learner.learner_api import TrainSample
from grpoflow.tasks.learner.logprobs import padded_logprobs, shared_prompt_logprobs, split_head
from tests.support import make_learner
from tests.support import train_samples as samples

pytestmark = pytest.mark.unit


def grads_of(learner) -> torch.Tensor:
    return torch.cat([p.grad.flatten() for p in learner.model.parameters() if p.grad is not None])


def head_rows(model) -> list[int]:
    """The number of positions of each call of `model`'s LM head, recorded from now on."""
    rows: list[int] = []
    head = split_head(model).head
    head.register_forward_hook(lambda m, args, out: rows.append(out.reshape(-1, out.shape[-1]).shape[0]))
    return rows


def batch() -> list[TrainSample]:
    """Two groups (prompts of lengths 3 and 5, one shared by two completions) and a lone prompt."""
    return [
        *samples(),
        TrainSample([11, 12, 13, 14, 15, 60, 61, 62], 5, [1, 1, 1], [-5.5] * 3, -0.5),
        TrainSample([11, 12, 13, 14, 15, 63], 5, [1], [-5.5], 0.25),
    ]


@pytest.mark.parametrize("share", [False, True])
@pytest.mark.parametrize("lora", [False, True])
def test_chunks_give_the_whole_heads_loss_and_gradients(tiny_model_dir, share, lora):
    runs = {}
    for chunk in (None, 3):
        fields = {"lora": {"rank": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj"]}} if lora else {}
        learner = make_learner(tiny_model_dir, lr=1e-3, total_steps=10, loss_type="grpo", seed=0,
                               share_prompt=share, micro_batch_size=8, lm_head_chunk=chunk, **fields)  # fmt: skip
        assert learner.share_prompt is share and learner.head_chunk == chunk
        learner.optimizer.step = lambda: None
        rows = head_rows(learner.model)
        runs[chunk] = (learner.train_step(batch())["train/loss"], grads_of(learner))
        if chunk is not None:
            assert rows and max(rows) <= chunk  # never the micro-batch's whole logits
        else:
            assert max(rows) > 3
    assert runs[3][0] == pytest.approx(runs[None][0], rel=1e-6)
    assert runs[3][1].shape == runs[None][1].shape
    assert torch.allclose(runs[3][1], runs[None][1], rtol=1e-4, atol=1e-7)


def random_gemma3():
    """A random Gemma 3 (sliding-window and full layers, tied embeddings) with a final logit softcap of
    0.05 (below a random model's logits, so the cap bends them)."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    torch.manual_seed(0)
    config = Gemma3TextConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                              num_attention_heads=2, num_key_value_heads=1, head_dim=16, sliding_window=4,
                              max_position_embeddings=64, final_logit_softcapping=0.05)  # fmt: skip
    return Gemma3ForCausalLM(config).float()


@pytest.mark.parametrize("forward", [padded_logprobs, shared_prompt_logprobs])
@pytest.mark.parametrize("arch", ["tiny", "gemma3"])
def test_the_head_runs_on_completion_tokens_only_with_the_whole_models_numbers(tiny_model_dir, forward, arch):
    # The micro-batch pads its completions (4, 3, 2, 3, 1 tokens) to 4 and, padded, its prompts (2, 3, 5)
    # to the longest: the whole model's head sees every position from the first that predicts a
    # completion token; apart, the head sees the 13 completion tokens' positions only (a masked one
    # included), and gives the same numbers.
    model = make_learner(tiny_model_dir, total_steps=1).model if arch == "tiny" else random_gemma3()
    out, rows = [], []
    for apart in (False, True):
        model.zero_grad()
        seen: list[int] = []
        hook = model.get_output_embeddings().register_forward_hook(
            lambda m, args, o, seen=seen: seen.append(o.reshape(-1, o.shape[-1]).shape[0])
        )
        mb = forward(model, batch(), temperature=0.7, pad_id=0, device=torch.device("cpu"), head_apart=apart)
        hook.remove()
        (mb.logprobs * mb.mask).sum().backward()
        out.append(
            (mb.logprobs.detach() * mb.mask, torch.cat([p.grad.flatten() for p in model.parameters()]))
        )
        rows.append(sum(seen))
    assert rows[1] == sum(len(s.completion_mask) for s in batch()) == 13 < rows[0]
    assert torch.allclose(out[1][0], out[0][0], atol=1e-6)
    assert torch.allclose(out[1][1], out[0][1], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("forward", [padded_logprobs, shared_prompt_logprobs])
def test_gemma3s_softcapped_logits_chunked_are_the_whole_heads(forward, tmp_path):
    """Gemma 3's final logit softcap: chunked logprobs and gradients are the whole head's."""
    model = random_gemma3()
    assert split_head(model).softcap == 0.05
    out = []
    for chunk in (None, 4):
        model.zero_grad()
        mb = forward(model, batch(), temperature=0.7, pad_id=0, device=torch.device("cpu"), head_chunk=chunk)
        (mb.logprobs * mb.mask).sum().backward()
        out.append((mb.logprobs.detach(), torch.cat([p.grad.flatten() for p in model.parameters()])))
    assert torch.allclose(out[1][0], out[0][0], atol=1e-6)
    assert torch.allclose(out[1][1], out[0][1], rtol=1e-4, atol=1e-5)  # gradients up to ~13 here
    # the cap is applied: without it these logprobs differ
    model.config.final_logit_softcapping = None
    with torch.no_grad():
        uncapped = forward(model, batch(), temperature=0.7, pad_id=0, device=torch.device("cpu")).logprobs
    assert not torch.allclose(uncapped, out[0][0], atol=1e-3)


def test_a_model_whose_logits_are_more_than_its_head_is_refused_by_name(tiny_model_dir, tmp_path):
    from transformers import GPT2Config, GPT2LMHeadModel

    GPT2LMHeadModel(GPT2Config(vocab_size=128, n_embd=16, n_layer=1, n_head=2)).save_pretrained(tmp_path)
    assert split_head(GPT2LMHeadModel.from_pretrained(tmp_path)) is None
    with pytest.raises(ValueError, match=r"learner.lm_head_chunk: a gpt2 model's logits are not its LM head"):
        make_learner(tmp_path, total_steps=1, tokenizer_path=tiny_model_dir, lm_head_chunk=8)

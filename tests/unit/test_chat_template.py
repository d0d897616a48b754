"""`model.chat_template`: the run's model dir carries the template a config names (tasks/models.py:
with_chat_template), on the tiny model, on SmolLM2-135M-Instruct's real tokenizer, whose own template
it replaces, and on the tiny Gemma 3, whose tokenizer keeps adding its BOS; the user's model dir is
never written; bad values fail in preflight naming the field."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from grpoflow.flows.config import ConfigError, GRPOConfig, load_config
from grpoflow.flows.training.preflight import preflight
from grpoflow.flows.training.runs import prepare_model
from grpoflow.tasks.models import with_chat_template

pytestmark = pytest.mark.unit

QA = "{% for m in messages %}Question: {{ m['content'] }}\n{% endfor %}{% if add_generation_prompt %}Answer:{% endif %}"
ASK = [{"role": "user", "content": "What is 2 + 3?"}]


def _render(model_dir) -> str:
    return AutoTokenizer.from_pretrained(model_dir).apply_chat_template(
        ASK, add_generation_prompt=True, tokenize=False
    )


def _files(d) -> dict:
    return {p.name: p.read_bytes() for p in sorted(d.iterdir()) if p.is_file()}


def test_the_templated_model_dir_renders_with_the_template_and_links_the_weights(tiny_model_dir, tmp_path):
    before = _files(tiny_model_dir)
    out = with_chat_template(tiny_model_dir, QA, tmp_path)
    assert _render(out) == "Question: What is 2 + 3?\nAnswer:"
    weights = sorted(out.glob("*.safetensors"))
    assert weights and all(w.is_symlink() and w.resolve().parent == tiny_model_dir.resolve() for w in weights)
    assert (out / "config.json").is_symlink()
    assert _files(tiny_model_dir) == before  # the base model is never written
    assert with_chat_template(tiny_model_dir, QA, tmp_path) == out  # made once
    assert [p.name for p in (tmp_path / "models").iterdir()] == [out.name]  # no temporary dir left
    other = with_chat_template(tiny_model_dir, QA.replace("Answer:", "A:"), tmp_path)
    assert other != out and _render(other).endswith("A:")


def test_a_template_file_replaces_smollm2s_own_template(smollm2_tokenizer_dir, tmp_path):
    own = _render(smollm2_tokenizer_dir)
    assert own.startswith("<|im_start|>")  # SmolLM2's ChatML
    path = tmp_path / "qa.jinja"
    path.write_text(QA)
    out = with_chat_template(smollm2_tokenizer_dir, str(path), tmp_path / "store")
    assert _render(out) == "Question: What is 2 + 3?\nAnswer:"
    assert _render(smollm2_tokenizer_dir) == own


def test_gemma3_keeps_its_bos_for_plain_text_under_a_chat_template(tiny_gemma3_dir, tmp_path):
    """Gemma 3 (no chat template of its own, a BOS-adding tokenizer): the templated dir renders with the
    template and its tokenizer still adds BOS to plain text, as the base model expects."""
    before = _files(tiny_gemma3_dir)
    out = with_chat_template(tiny_gemma3_dir, QA, tmp_path)
    tok = AutoTokenizer.from_pretrained(out)  # one load: 262k tokens take seconds
    assert tok.apply_chat_template(ASK, add_generation_prompt=True, tokenize=False) == (
        "Question: What is 2 + 3?\nAnswer:"
    )
    ids = tok("Question").input_ids
    assert tok.bos_token_id == 2 and ids == [2, *tok("Question", add_special_tokens=False).input_ids]
    weights = sorted(out.glob("*.safetensors"))
    assert weights and all(
        w.is_symlink() and w.resolve().parent == tiny_gemma3_dir.resolve() for w in weights
    )
    assert _files(tiny_gemma3_dir) == before  # the base model is never written
    assert "chat_template.jinja" not in before and b"chat_template" not in before["tokenizer_config.json"]


def test_a_run_starts_from_the_templated_dir_and_a_file_is_found_beside_its_config(tmp_path):
    (tmp_path / "conf").mkdir()
    (tmp_path / "conf" / "qa.jinja").write_text(QA)
    cfg_file = tmp_path / "conf" / "run.yaml"
    cfg_file.write_text(
        f"storage: {{root: {tmp_path / 'store'}}}\nmodel: {{chat_template: qa.jinja}}\n"
        "rewards: [{name: a, fn: 'grpoflow.examples.rewards:letter_fraction'}]\n"
        "data: {generator: 'grpoflow.examples.envs:letters_rows'}\n"
    )
    cfg = load_config(cfg_file)
    assert cfg.model.chat_template == str(tmp_path / "conf" / "qa.jinja")
    preflight(cfg)
    base = prepare_model(cfg)
    assert base.parent == tmp_path / "store" / "models" and "chat-template" in base.name
    assert _render(base) == "Question: What is 2 + 3?\nAnswer:"


def test_a_chat_template_that_is_neither_a_file_nor_a_template_fails_in_preflight(tmp_path):
    cfg = GRPOConfig.model_validate(
        {"storage": {"root": str(tmp_path)}, "model": {"chat_template": "nope.jinja"}}
    )
    with pytest.raises(ConfigError, match=r"model.chat_template: neither a template nor a file: nope.jinja"):
        preflight(cfg)

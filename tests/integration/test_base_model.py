"""A base model on plain-text prompts (TRL's standard format), on the real vLLM server: the tiny model
with its chat template taken away trains on "Question: ... Answer:" rows sent as they are, and the
rollouts table holds exactly the tokens the model saw; with `model.chat_template` the same model renders
conversational rows through the template the config gives."""

from __future__ import annotations

import json
import shutil

import pytest
from transformers import AutoTokenizer

from grpoflow.storage.rollouts import RolloutStore
from tests.support import tiny_cfg

pytestmark = pytest.mark.integration

QUESTIONS = [f"Question: Write a word with {n} letters a.\nAnswer:" for n in range(1, 9)]
QA = "{% for m in messages %}Question: {{ m['content'] }}\n{% endfor %}{% if add_generation_prompt %}Answer:{% endif %}"


@pytest.fixture(scope="module")
def base_model_dir(tiny_model_dir, tmp_path_factory):
    """The tiny model as a base model ships: no chat template."""
    out = tmp_path_factory.mktemp("base") / "tiny-base"
    shutil.copytree(tiny_model_dir, out)
    (out / "chat_template.jinja").unlink(missing_ok=True)
    config = json.loads((out / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (out / "tokenizer_config.json").write_text(json.dumps(config))
    assert AutoTokenizer.from_pretrained(out).chat_template is None
    return out


def _train(tmp_path, model_dir, url, rows, run_id, **sets):
    from grpoflow.flows.training.train import grpo_train

    data = tmp_path / f"{run_id}.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = tiny_cfg(tmp_path, model_dir, url, **{"run.run_id": run_id, "run.steps": 2, "data.path": data,
                                                "data.prompts_per_step": 4, "generation.group_size": 2, **sets})  # fmt: skip
    grpo_train(config=cfg)
    return RolloutStore(tmp_path).read_groups(run_id)


def test_a_base_model_trains_on_plain_text_prompts_sent_as_they_are(
    tmp_path, vllm_server, base_model_dir, prefect_api
):
    tok = AutoTokenizer.from_pretrained(base_model_dir)
    groups = _train(tmp_path, base_model_dir, vllm_server.url, [{"prompt": q} for q in QUESTIONS], "plain")
    assert len(groups) == 8 and all(len(g.completions) == 2 for g in groups)
    for g in groups:
        assert g.prompt in QUESTIONS and g.prompt_ids == tok.encode(g.prompt, add_special_tokens=True)
        assert tok.decode(g.prompt_ids) == g.prompt  # the text itself, no template around it


def test_model_chat_template_renders_conversational_prompts_for_a_model_without_one(
    tmp_path, vllm_server, base_model_dir, prefect_api
):
    rows = [{"prompt": [{"role": "user", "content": f"Write {n} letters a."}]} for n in range(1, 9)]
    template = tmp_path / "qa.jinja"
    template.write_text(QA)
    groups = _train(
        tmp_path, base_model_dir, vllm_server.url, rows, "templated", **{"model.chat_template": template}
    )
    assert len(groups) == 8
    tok = AutoTokenizer.from_pretrained(base_model_dir)
    for g in groups:
        assert g.prompt.startswith("Question: Write ") and g.prompt.endswith(" letters a.\nAnswer:")
        assert g.prompt_ids == tok.encode(g.prompt, add_special_tokens=False)

"""The SFT warm-up (`warmup` section): what it learns, on which prompt, and when it runs."""

from __future__ import annotations

import json

import pytest

from grpoflow.flows.config import ConfigError, GRPOConfig
from grpoflow.flows.training.environments import check_run
from grpoflow.tasks.config.algorithm import WarmupConfig
from grpoflow.tasks.config.rollouts import ToolsConfig
from grpoflow.tasks.rollouts.templates import TemplateError
from grpoflow.tasks.rollouts.tools import HermesToolParser
from grpoflow.tasks.warmup import IGNORE, PromptRenderer, example_ids, load_examples

CALC = ToolsConfig(tools=["grpoflow.examples.tools:calculator"])


def _learned(tok, ids, labels) -> str:
    return tok.decode([i for i, lab in zip(ids, labels, strict=True) if lab != IGNORE])


def test_smollm2_learns_the_assistant_turns_only_on_the_rollout_prompt(smollm2_tokenizer_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_tokenizer_dir)
    renderer = PromptRenderer(tok, CALC, HermesToolParser())
    ex = load_examples(
        WarmupConfig(examples="grpoflow.examples.warmup:calculator_replies", examples_kwargs={"n": 2})
    )[0]
    prompt = renderer.messages(ex, 0)
    # SmolLM2's template ignores tools=: the schema and the call format go into the system turn
    assert renderer.in_system(renderer.schemas({}))
    assert prompt[0]["role"] == "system" and '"name": "calculator"' in prompt[0]["content"]
    ids, labels = example_ids(tok, prompt, ex["reply"], renderer.schemas(ex), 0)
    answer = str(ex["answer"])
    call = f'<tool_call>{{"name": "calculator", "arguments": {{"expression": "{ex["a"]} * {ex["b"]}"}}}}</tool_call>'
    # both assistant turns, each through its end-of-turn token; never the prompt or the tool result
    assert _learned(tok, ids, labels) == f"{call}<|im_end|>{answer}<|im_end|>"
    assert tok.decode(ids).startswith(
        tok.apply_chat_template(prompt, add_generation_prompt=True, tokenize=False)
    )
    assert tok.decode(ids).count(answer) == 2  # the tool's result (context) and the final answer (learned)


def test_a_template_that_renders_tools_keeps_them_out_of_the_system_turn():
    from grpoflow.tasks.tiny_model import build_tokenizer

    tok = build_tokenizer()
    renderer = PromptRenderer(
        tok, ToolsConfig(environment="grpoflow.examples.envs:CounterEnv"), HermesToolParser()
    )
    schemas = renderer.schemas({"prompt": "Count."})
    assert not renderer.in_system(schemas)
    assert [s["function"]["name"] for s in schemas] == ["increment"]
    msgs = renderer.messages({"prompt": "Count."}, 0)
    assert msgs == [
        {"role": "user", "content": "Count.\n\nA counter starts at 0. Call the increment tool to raise it."}
    ]
    ids, labels = example_ids(tok, msgs, '<tool_call>{"name": "increment", "arguments": {"by": 1}}</tool_call>',
                              schemas, 0)  # fmt: skip
    assert _learned(tok, ids, labels).endswith("</tool_call><|im_end|>")


def test_bad_examples_name_the_field_and_the_row():
    with pytest.raises(ValueError, match="warmup.steps is 5 but warmup.examples is not set"):
        WarmupConfig(steps=5)
    with pytest.raises(ConfigError, match="warmup.examples"):
        check_run(GRPOConfig(warmup={"examples": "grpoflow.examples.warmup:no_such_function", "steps": 1}))
    rows = [{"prompt": "a", "reply": "b"}, {"prompt": "c"}]
    with pytest.raises(ValueError, match="example 1 needs 'prompt' and 'reply'"):
        load_examples(WarmupConfig(examples=lambda: rows))
    with pytest.raises(ValueError, match="returned no examples"):
        load_examples(WarmupConfig(examples=lambda: []))


def test_a_template_that_rewrites_earlier_turns_is_refused():
    from grpoflow.tasks.tiny_model import build_tokenizer

    tok = build_tokenizer()
    # drops every assistant turn but the last: the conversation is not a prefix of itself plus a turn
    tok.chat_template = (
        "{% for m in messages %}{% if m.role != 'assistant' or loop.last %}"
        "<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    reply = [
        {"role": "assistant", "content": "x"},
        {"role": "tool", "content": "1"},
        {"role": "assistant", "content": "y"},
    ]
    with pytest.raises(TemplateError, match="warmup example 3"):
        example_ids(tok, [{"role": "user", "content": "q"}], reply, None, 3)


def test_warm_up_runs_once_per_model_and_settings(tmp_path):
    from grpoflow.flows.training.runs import prepare_model

    def cfg(**warmup):
        return GRPOConfig(
            model={"path": "tiny"},
            storage={"root": str(tmp_path)},
            tools={"tools": ["grpoflow.examples.tools:calculator"]},
            warmup={"examples": "grpoflow.examples.warmup:single_calls",
                    "examples_kwargs": {"tool": "calculator", "argument": "expression", "values": ["1 + 2"], "n": 8},
                    "steps": 6, "batch_size": 2, "lr": 3e-3, **warmup},
        )  # fmt: skip

    first = prepare_model(cfg())
    stats = json.loads((first / "warmup.json").read_text())
    assert stats["steps"] == 6 and stats["loss_last"] < stats["loss_first"]
    assert (first / "config.json").is_file() and (first / "tokenizer_config.json").is_file()
    weights = (first / "model.safetensors").stat().st_mtime_ns
    assert prepare_model(cfg()) == first  # cached: the same settings do not train again
    assert (first / "model.safetensors").stat().st_mtime_ns == weights
    assert prepare_model(cfg(steps=7)) != first  # other settings warm up anew
    assert prepare_model(cfg(steps=0)) == tmp_path / "models" / "tiny"  # no warm-up: the base model
    assert not list((tmp_path / "models").glob(".*partial"))

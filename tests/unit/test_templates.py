"""Multi-turn token glue with real chat templates: SmolLM2-135M-Instruct's own tokenizer and template,
and Llama-3-, Qwen2.5- and Zephyr-style templates (written below) on the same real tokenizer.

The model is a SCRIPTED FAKE backend (tests/unit/test_generate.py): the test must control exactly
what the model says (a tool call with a trailing newline, then an answer). Everything else is real:
tokenizer, template rendering, tool execution, masks.
"""

from __future__ import annotations

import asyncio
import json

import pytest
from transformers import AutoTokenizer

import grpoflow.tasks.rollouts.generate as gen
from grpoflow.tasks.config.rollouts import GenerationConfig, ToolsConfig
from grpoflow.tasks.rollouts.templates import TemplateError, with_system_text
from grpoflow.tasks.rollouts.tools import HermesToolParser, tool_schema
from tests.unit.scripted import ScriptedBackend, one_server

pytestmark = pytest.mark.unit

# Llama-3.1 style: contents are `| trim`med, tool results go to the `ipython` role, turns end in
# <|eot_id|>, which is also the tokenizer's EOS.
LLAMA3 = (
    "{{- bos_token }}"
    "{%- if tools %}{{- '<|start_header_id|>system<|end_header_id|>\\n\\nYou may call these functions:\\n' }}"
    "{%- for t in tools %}{{- t | tojson }}{{- '\\n' }}{%- endfor %}{{- '<|eot_id|>' }}{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'tool' %}"
    "{{- '<|start_header_id|>ipython<|end_header_id|>\\n\\n' + message.content | trim + '<|eot_id|>' }}"
    "{%- else %}"
    "{{- '<|start_header_id|>' + message.role + '<|end_header_id|>\\n\\n' + message.content | trim + '<|eot_id|>' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"
)

# Qwen2.5 style: tools in the system turn, consecutive tool results grouped in one user turn.
QWEN25 = (
    "{%- if tools %}{{- '<|im_start|>system\\nYou are a helpful assistant.\\n\\n# Tools\\n\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}"
    "{{- '\\n</tools>\\n\\nReturn a json object within <tool_call></tool_call> tags.<|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'user' or message.role == 'assistant' %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{%- if loop.index0 == 0 or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

# Zephyr style: EOS only after a *final* assistant message, so the history is not a prefix of the
# next turn's render (the assumption the old glue code made).
ZEPHYR = (
    "{%- for m in messages %}{{ '<|' + m.role + '|>\\n' + m.content }}"
    "{%- if m.role == 'assistant' and loop.last and not add_generation_prompt %}{{ eos_token }}{%- endif %}"
    "{{ '\\n' }}{%- endfor %}{%- if add_generation_prompt %}{{ '<|assistant|>\\n' }}{%- endif %}"
)

CALL = '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>\n'  # trailing newline
ANSWER = "The answer is 5."

# (template, extra special tokens, EOS, the exact text between the model's two turns)
CASES = {
    "smollm2": (None, [], None, "\n<|im_start|>tool\n5<|im_end|>\n<|im_start|>assistant\n"),
    "llama3": (
        LLAMA3,
        ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"],
        "<|eot_id|>",
        "<|start_header_id|>ipython<|end_header_id|>\n\n5<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n",
    ),
    "qwen25": (
        QWEN25,
        [],
        None,
        "\n<|im_start|>user\n<tool_response>\n5\n</tool_response><|im_end|>\n<|im_start|>assistant\n",
    ),
    "zephyr": (ZEPHYR, [], None, "\n<|tool|>\n5\n<|assistant|>\n"),
}


def add(a: int, b: int) -> int:
    """Add two numbers.

    Args:
        a: first
        b: second
    """
    return a + b


def _tokenizer(path, case):
    template, specials, eos, _ = CASES[case]
    tok = AutoTokenizer.from_pretrained(path)
    if specials:
        tok.add_special_tokens({"additional_special_tokens": specials})
        tok.bos_token = specials[0]
    if eos:
        tok.eos_token = eos
    if template:
        tok.chat_template = template
    return tok


@pytest.mark.parametrize("case", sorted(CASES))
def test_multi_turn_glue_is_the_templates_own_text_and_masks_align(smollm2_tokenizer_dir, case):
    tok = _tokenizer(smollm2_tokenizer_dir, case)

    async def script(text, k, seed):
        return ANSWER if "5" in text.split(CALL.strip())[-1] else CALL

    (g,) = asyncio.run(
        gen.generate_groups(
            [{"prompt": "What is 2 + 3?"}],
            [0],
            servers=one_server(ScriptedBackend(tok, script, 4096)),
            tokenizer=tok,
            generation=GenerationConfig(group_size=2, max_tokens=64, max_turns=3),
            tools=ToolsConfig(tools=[add]),
        )
    )
    for c in g.completions:
        assert c.num_turns == 2 and c.tool_calls[0].result == "5" and not c.tool_calls[0].failed
        # the prompt is the template's own rendering, tools included: by the template where it renders
        # `tools=` (llama3, qwen25), else in a system turn grpoflow writes (smollm2, zephyr)
        schemas = [tool_schema(add)]
        user = [{"role": "user", "content": "What is 2 + 3?"}]
        if case in ("smollm2", "zephyr"):
            user = with_system_text(user, HermesToolParser().instructions(schemas))
        expected_prompt = tok.apply_chat_template(
            user, tools=schemas, add_generation_prompt=True, tokenize=False
        )
        assert tok.decode(g.prompt_ids) == expected_prompt
        # mask 1 = exactly the sampled tokens (EOS included), behaviour logprobs one to one
        generated = [t for turn in c.turns for t in turn.output_ids]
        assert [i for i, m in zip(c.completion_ids, c.completion_mask, strict=True) if m] == generated
        assert [lp for lp, m in zip(c.logprobs, c.completion_mask, strict=True) if m] == [
            lp for turn in c.turns for lp in turn.logprobs
        ]
        assert all(lp == 0.0 for lp, m in zip(c.logprobs, c.completion_mask, strict=True) if not m)
        # mask 0 = the template's text between the turns, nothing shifted, nothing doubled
        first = len(c.turns[0].output_ids)
        second = len(c.turns[1].output_ids)
        glue = c.completion_ids[first : len(c.completion_ids) - second]
        assert set(c.completion_mask[first : first + len(glue)]) == {0}
        assert tok.decode(glue) == CASES[case][3]
        assert tok.decode(c.completion_ids[:first]) == CALL + tok.eos_token


def test_a_template_that_drops_assistant_content_fails_with_a_clear_error(smollm2_tokenizer_dir):
    tok = AutoTokenizer.from_pretrained(smollm2_tokenizer_dir)
    tok.chat_template = (
        "{%- for m in messages %}{%- if m.role != 'assistant' %}{{ '<|' + m.role + '|>' + m.content }}"
        "{%- endif %}{%- endfor %}{%- if add_generation_prompt %}{{ '<|assistant|>' }}{%- endif %}"
    )

    async def script(text, k, seed):
        return CALL

    with pytest.raises(TemplateError, match="assistant message's content"):
        asyncio.run(
            gen.generate_groups(
                [{"prompt": "p"}],
                [0],
                servers=one_server(ScriptedBackend(tok, script, 4096)),
                tokenizer=tok,
                generation=GenerationConfig(group_size=1, max_tokens=64, max_turns=2),
                tools=ToolsConfig(tools=[add]),
            )
        )


def test_smollm2_template_renders_tool_calls_the_hermes_parser_reads(smollm2_tokenizer_dir):
    tok = AutoTokenizer.from_pretrained(smollm2_tokenizer_dir)
    text = tok.apply_chat_template([{"role": "assistant", "content": CALL}], tokenize=False)
    (parsed,) = HermesToolParser().parse(text)
    assert (parsed.name, parsed.arguments) == ("add", json.loads(CALL.strip()[11:-12])["arguments"])


@pytest.mark.parametrize("describe", ["auto", "system", "template"])
def test_tools_are_stated_in_the_system_turn_when_smollm2s_template_ignores_them(
    smollm2_tokenizer_dir, describe
):
    """SmolLM2's template drops `tools=`: told nothing, the model never calls a tool. grpoflow writes
    the tools and the parser's call format into the system turn ('auto' detects the template)."""
    tok = AutoTokenizer.from_pretrained(smollm2_tokenizer_dir)
    bare = tok.apply_chat_template(
        [{"role": "user", "content": "q"}], add_generation_prompt=True, tokenize=False
    )
    assert bare == tok.apply_chat_template(
        [{"role": "user", "content": "q"}],
        tools=[tool_schema(add)],
        add_generation_prompt=True,
        tokenize=False,
    )  # the premise: this template ignores tools=

    async def script(text, k, seed):
        return ANSWER

    (g,) = asyncio.run(
        gen.generate_groups(
            [{"prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2 + 3?"}]}],
            [0],
            servers=one_server(ScriptedBackend(tok, script, 4096)),
            tokenizer=tok,
            generation=GenerationConfig(group_size=1, max_tokens=16, max_turns=2),
            tools=ToolsConfig(tools=[add], describe_tools=describe),
        )
    )
    prompt = g.completions[0].prompt
    system = prompt.split("<|im_end|>")[0]
    if describe == "template":
        assert system == "<|im_start|>system\nBe brief." and "<tool_call>" not in prompt
    else:  # the user's system text first, then the tools and the exact format the parser reads
        assert system.startswith("<|im_start|>system\nBe brief.\n\nYou can call these tools:")
        assert '"name": "add"' in system and '<tool_call>{"name": "<tool name>", "arguments"' in system
        (call,) = HermesToolParser().parse(CALL)
        assert call.name == "add"

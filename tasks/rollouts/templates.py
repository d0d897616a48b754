"""Prompts and chat-template rendering, as rollouts (and the warm-up, which renders its examples the
same way) build them: a row's prompt as messages, the tools in the system turn when the template
ignores `tools=`, an environment's reset note, and the template glue between a multi-turn rollout's
turns.
"""

from __future__ import annotations

import functools
from typing import Any


def prompt_messages(row: dict[str, Any], index: int) -> list[dict[str, Any]]:
    """The row's prompt as chat messages: a conversational prompt as it is; a plain-text one as one user
    message, which only a multi-turn rollout (tools, an environment: a conversation) and the warm-up's
    examples render so. A single-turn rollout sends a plain-text prompt as it is (`plain_text_ids`)."""
    if "prompt" not in row:
        raise ValueError(f"row {index} has no 'prompt' field")
    p = row["prompt"]
    if isinstance(p, str):
        return [{"role": "user", "content": p}]
    if isinstance(p, list) and all(isinstance(m, dict) and "role" in m for m in p):
        return [dict(m) for m in p]
    raise ValueError(f"row {index}: 'prompt' must be a string or a list of chat messages")


def plain_text_ids(tokenizer, text: str) -> list[int]:
    """TRL's rule for a plain-text prompt (a base model's "Question: ... Answer:"): its text as it is,
    no chat template, with the special tokens the tokenizer adds (its BOS, for Llama, Gemma and the
    like), and never a second BOS when the text already starts with one."""
    ids = tokenizer.encode(text, add_special_tokens=True)
    bos = tokenizer.bos_token_id
    if bos is not None and ids[:2] == [bos, bos]:
        ids = ids[1:]
    return ids


def with_system_text(messages: list[dict], text: str) -> list[dict]:
    """`messages` with `text` appended to their system turn, or in a new system turn first."""
    if messages and messages[0].get("role") == "system":
        return [{**messages[0], "content": f"{messages[0]['content']}\n\n{text}"}, *messages[1:]]
    return [{"role": "system", "content": text}, *messages]


def render(tokenizer, messages, schemas, generation_prompt: bool) -> str:
    return tokenizer.apply_chat_template(
        messages, tools=schemas or None, add_generation_prompt=generation_prompt, tokenize=False
    )


def template_ignores_tools(tokenizer, schemas: list[dict]) -> bool:
    probe = [{"role": "user", "content": "?"}]
    return render(tokenizer, probe, schemas, True) == render(tokenizer, probe, None, True)


def tools_in_system_turn(describe_tools: str, tokenizer, schemas: list[dict]) -> bool:
    """Whether the tools and the call format go into the system turn: `tools.describe_tools`
    'system', or 'auto' and the chat template ignores `tools=` (SmolLM2's and many small models'
    templates do; a model that is never told its tools never calls them)."""
    if describe_tools != "auto":
        return describe_tools == "system"
    return template_ignores_tools(tokenizer, schemas)


def with_reset_note(messages: list[dict], note: Any) -> list[dict]:
    """`messages` with an environment's `reset` note (a non-empty string) appended to the last one (its
    whole content when that is empty: an environment that owns its data gives the prompt)."""
    if not (isinstance(note, str) and note):
        return messages
    content = messages[-1]["content"]
    return [*messages[:-1], {**messages[-1], "content": f"{content}\n\n{note}" if content else note}]


class TemplateError(ValueError):
    """The tokenizer's chat template cannot support multi-turn rollouts."""


# Stands in for the assistant's text when rendering glue: plain ASCII with no whitespace, so no
# template filter (trim, strip) alters it, and no tokenizer or model ever sees it.
_SENTINEL = "GRPOFLOWASSISTANTCONTENT8d1f"


def glue_ids(
    tokenizer, eos_text: str, history: list[dict], ended_with_eos: bool, tool_msgs, schemas
) -> list[int]:
    """Template tokens between the model's output and the next generation: the closing of the
    assistant turn (minus the EOS the model already produced), tool messages, generation prompt.

    The assistant turn is rendered with a sentinel in place of the model's text and the glue is
    what follows the sentinel: templates that trim or rewrite the content (Llama-3's `| trim`), or
    that render earlier turns differently once more follow, cannot shift it. The model's own
    tokens are kept as sampled, never re-rendered."""
    asst = {"role": "assistant", "content": _SENTINEL}
    full = render(tokenizer, history + [asst] + tool_msgs, schemas, True)
    if full.count(_SENTINEL) != 1:
        raise TemplateError(
            "the chat template does not render an assistant message's content verbatim once "
            f"(found it {full.count(_SENTINEL)} times); multi-turn rollouts need that"
        )
    glue = full[full.index(_SENTINEL) + len(_SENTINEL) :]
    if ended_with_eos and eos_text and glue.lstrip(" \t").startswith(eos_text):
        glue = glue.lstrip(" \t")[len(eos_text) :]
    return tokenizer.encode(glue, add_special_tokens=False)


@functools.lru_cache(maxsize=4)
def load_tokenizer(path: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)

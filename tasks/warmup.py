"""Supervised warm-up before RL (the `warmup` section): a few SFT steps on example replies.

A model that never writes a tool call gets no signal from a tool-use reward: every completion of a
group scores alike, so nothing trains. The warm-up shows it the call format on prompts rendered
exactly as rollouts render them (the tools in the chat template or in the system turn, in the format
the tool-call parser reads, with an environment's reset note: an environment server's session is opened
for each example, as a rollout's is), and learns only the assistant's tokens
(through its end-of-turn token). `warm_up` writes the warmed model and `warmup.json` (steps, seconds,
loss at the first and last step); flows cache it per model and settings.

It sits beside the subsystems, not in the learner: it renders prompts with the rollouts' templates and
tool parsers and trains with its own small SFT loop, so it depends on rollouts one way and nothing in
tasks/learner or tasks/rollouts imports it (flows/training/runs.py calls it).
"""

from __future__ import annotations

import inspect
import json
import random
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from grpoflow.storage.rollouts import atomic_publish_dir
from grpoflow.tasks.config.algorithm import WarmupConfig
from grpoflow.tasks.config.rollouts import ToolsConfig
from grpoflow.tasks.rollouts.openenv import resolve_environment
from grpoflow.tasks.rollouts.templates import (
    TemplateError,
    prompt_messages,
    render,
    tools_in_system_turn,
    with_reset_note,
    with_system_text,
)
from grpoflow.tasks.rollouts.tools import (
    HermesToolParser,
    ToolCallParser,
    environment_tools,
    resolve_callable,
    tool_schema,
)
from grpoflow.tasks.threads import run_blocking

IGNORE = -100  # labels the loss skips


def callable_name(obj: Any) -> str:
    """An import path as given, or a callable's `module:qualname` (for cache keys and messages)."""
    if isinstance(obj, str) or obj is None:
        return str(obj)
    return f"{getattr(obj, '__module__', '?')}:{getattr(obj, '__qualname__', repr(obj))}"


def load_examples(warmup: WarmupConfig) -> list[dict[str, Any]]:
    fn = resolve_callable(warmup.examples)
    examples = list(fn(**warmup.examples_kwargs))
    if not examples:
        raise ValueError(f"warmup.examples: {callable_name(warmup.examples)} returned no examples")
    for i, ex in enumerate(examples):
        if not isinstance(ex, dict) or "prompt" not in ex or "reply" not in ex:
            raise ValueError(f"warmup.examples: example {i} needs 'prompt' and 'reply', got {ex!r:.200}")
    return examples


class PromptRenderer:
    """The first turn's messages as a rollout builds them: the row's prompt, the environment's reset
    note (the one the row's `environment` column names, in TRL's dict form), and the tools in the
    system turn when the template does not render them."""

    def __init__(self, tokenizer, tools: ToolsConfig, parser: ToolCallParser):
        self.tok, self.parser, self.describe = tokenizer, parser, tools.describe_tools
        self.fns = [resolve_callable(t) for t in tools.tools]
        self.envs = {name: resolve_environment(f)() for name, f in tools.environments().items()}

    def _env(self, row: dict[str, Any]) -> Any:
        return self.envs.get(None if None in self.envs else row.get("environment"))

    def schemas(self, row: dict[str, Any]) -> list[dict[str, Any]]:
        """The tools `row`'s rollouts see: the functions, and its environment's methods."""
        env = self._env(row)
        fns = self.fns + (list(environment_tools(env).values()) if env is not None else [])
        return [tool_schema(f) for f in fns]

    def in_system(self, schemas: list[dict[str, Any]]) -> bool:
        return bool(schemas) and tools_in_system_turn(self.describe, self.tok, schemas)

    def messages(self, row: dict[str, Any], index: int) -> list[dict[str, Any]]:
        history, env = prompt_messages(row, index), self._env(row)
        if env is not None:
            note = env.reset(**{k: v for k, v in row.items() if k != "reply"})
            if inspect.isawaitable(note):  # an environment server's session: its reset, and its tools
                note = run_blocking(_session_note(env, note))
            history = with_reset_note(history, note)
        schemas = self.schemas(row)
        if self.in_system(schemas):
            history = with_system_text(history, self.parser.instructions(schemas))
        return history


async def _session_note(env: Any, reset: Any) -> Any:
    """An environment server's session opened for one example (tasks/rollouts/openenv.py): what its reset
    says, as a rollout's prompt has it; the session closed again, its tools' schemas kept (`schemas`)."""
    try:
        return await reset
    finally:
        await env.aclose()


def example_ids(tok, prompt: list[dict], reply: str | list[dict], schemas, index: int):
    """Token ids of one conversation and its labels: each assistant turn's tokens up to and including
    the end-of-turn token; everything else (prompt, tool results, template glue) is IGNORE."""
    turns = [{"role": "assistant", "content": reply}] if isinstance(reply, str) else list(reply)
    eos = tok.eos_token or ""
    ids: list[int] = []
    labels: list[int] = []
    conv, done = list(prompt), ""
    for m in turns:
        if m.get("role") == "assistant":
            before = render(tok, conv, schemas, True)
            after = render(tok, [*conv, m], schemas, False)
            if not before.startswith(done) or not after.startswith(before):
                raise TemplateError(
                    f"warmup example {index}: the chat template does not render the conversation "
                    "as a prefix of itself plus the assistant turn; it cannot be learned turn by turn"
                )
            target = after[len(before) :]
            if eos and eos in target:
                target = target[: target.index(eos) + len(eos)]
            context = tok.encode(before[len(done) :], add_special_tokens=False)
            learned = tok.encode(target, add_special_tokens=False)
            ids += context + learned
            labels += [IGNORE] * len(context) + learned
            done = before + target
        conv.append(m)
    if not any(x != IGNORE for x in labels):
        raise ValueError(f"warmup example {index}: its reply has no assistant turn to learn")
    return ids, labels


def warm_up(
    base: str | Path,
    out: str | Path,
    warmup: WarmupConfig,
    tools: ToolsConfig,
    *,
    seed: int = 0,
    parser: ToolCallParser | None = None,
    log: Callable[[str], Any] = print,
) -> dict[str, Any]:
    """SFT `base` for `warmup.steps` steps and write the result to `out` (complete or absent: it is
    written beside `out` and renamed into place). Returns the figures also written to warmup.json."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    base, out = Path(base), Path(out)
    tok = AutoTokenizer.from_pretrained(base)
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    renderer = PromptRenderer(tok, tools, parser or HermesToolParser())
    encoded = [
        example_ids(tok, renderer.messages(ex, i), ex["reply"], renderer.schemas(ex), i)
        for i, ex in enumerate(load_examples(warmup))
    ]
    model = AutoModelForCausalLM.from_pretrained(base, dtype="auto")
    saved_dtype = model.dtype
    model = model.float().train()
    t0 = time.perf_counter()
    losses = _sft(model, encoded, warmup, pad, seed)
    stats = {
        "base": str(base),
        "examples": callable_name(warmup.examples),
        "n_examples": len(encoded),
        "steps": warmup.steps,
        "batch_size": warmup.batch_size,
        "lr": warmup.lr,
        "seed": seed,
        "seconds": round(time.perf_counter() - t0, 2),
        "loss_first": round(losses[0], 4) if losses else None,
        "loss_last": round(losses[-1], 4) if losses else None,
    }

    def write(d: Path) -> None:
        model.to(saved_dtype).save_pretrained(d, safe_serialization=True)
        tok.save_pretrained(d)
        (d / "warmup.json").write_text(json.dumps(stats, indent=1))

    atomic_publish_dir(out, write)
    log(
        f"warm-up: {stats['steps']} SFT steps on {stats['n_examples']} examples in {stats['seconds']} s, "
        f"loss {stats['loss_first']} -> {stats['loss_last']}"
    )
    return stats


def _sft(model, encoded: list[tuple[list[int], list[int]]], warmup: WarmupConfig, pad: int, seed: int):
    """`warmup.steps` AdamW steps on batches of `encoded` drawn with `seed`, each padded to its longest
    example; the loss of each step."""
    import torch

    torch.manual_seed(seed)
    rng = random.Random(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=warmup.lr, weight_decay=0.0)
    losses = []
    for _ in range(warmup.steps):
        batch = [encoded[rng.randrange(len(encoded))] for _ in range(warmup.batch_size)]
        width = max(len(ids) for ids, _ in batch)
        x = torch.tensor([ids + [pad] * (width - len(ids)) for ids, _ in batch])
        y = torch.tensor([lab + [IGNORE] * (width - len(lab)) for _, lab in batch])
        attn = torch.tensor([[1] * len(ids) + [0] * (width - len(ids)) for ids, _ in batch])
        loss = model(input_ids=x, attention_mask=attn, labels=y).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
    return losses

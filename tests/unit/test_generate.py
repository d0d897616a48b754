"""Rollout generation against a SCRIPTED FAKE backend (the real tiny tokenizer, scripted model output).

The fake stands in for the vLLM server only where the test needs to control what the model says
(tool calls, lengths); the integration tests drive the real server.
"""

from __future__ import annotations

import asyncio
import copy
import json
import threading

import pytest

import grpoflow.tasks.rollouts.generate as gen
from grpoflow.examples.envs import CounterEnv
from grpoflow.tasks.config.rollouts import GenerationConfig, ToolsConfig
from grpoflow.tasks.rollouts.multi_turn import snapshot
from grpoflow.tasks.rollouts.tools import HermesToolParser, tool_schema
from grpoflow.tasks.tiny_model import build_tokenizer
from tests.support import toolbox
from tests.unit.scripted import ScriptedBackend, one_server

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


def call(name, **args):
    return f"<tool_call>{json.dumps({'name': name, 'arguments': args})}</tool_call>"


def run(coro):
    return asyncio.run(coro)


def _plain(tok, prompt: str):
    async def script(text, k, seed):
        return "a"

    groups = run(gen.generate_groups([{"prompt": prompt}], [0], servers=one_server(ScriptedBackend(tok, script)),
                                     tokenizer=tok, generation=GenerationConfig(group_size=2), seed=1))  # fmt: skip
    return groups[0]


def _with_bos(tok):
    """The tiny tokenizer made to add a BOS as Llama's and Gemma's do (written here: neither ships)."""
    from tokenizers.processors import TemplateProcessing

    bos = copy.deepcopy(tok)
    bos.add_special_tokens({"bos_token": "<s>"})
    bos.backend_tokenizer.post_processor = TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", bos.bos_token_id)]
    )
    return bos


def _tokenizer(name: str, tok, request):
    """The tokenizer a plain-text test runs with: the tiny one, the tiny one made to add a BOS, or the
    real SmolLM2 and Gemma 3 ones (Gemma's adds its BOS itself, as its GGUF states)."""
    if name == "tiny":
        return tok
    if name == "tiny-with-bos":
        return _with_bos(tok)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(request.getfixturevalue(f"{name}_tokenizer_dir"))


@pytest.mark.parametrize(
    "name, adds_bos",
    [("tiny", False), ("smollm2", False), ("tiny-with-bos", True), ("gemma3", True)],
)
def test_a_plain_text_prompt_is_sent_as_it_is_with_the_tokenizers_special_tokens_bos_once(
    tok, request, name, adds_bos
):
    t = _tokenizer(name, tok, request)
    question = "Question: What is 2 + 3?\nAnswer:"
    g = _plain(t, question)
    text_ids = t.encode(question, add_special_tokens=False)
    assert g.prompt_ids == t.encode(question, add_special_tokens=True)
    assert g.prompt == question  # no chat template around it
    if not adds_bos:  # neither the tiny tokenizer nor SmolLM2's adds a BOS
        assert g.prompt_ids == text_ids and t.decode(g.prompt_ids) == question
        return
    bos = t.bos_token_id
    assert bos is not None and bos not in text_ids
    assert g.prompt_ids == [bos, *text_ids]  # exactly one BOS, first
    written = t.bos_token + question  # a BOS written in the text ("<s>", Gemma's "<bos>"): once
    assert t.encode(written, add_special_tokens=True)[:2] == [bos, bos]  # what the tokenizer alone gives
    assert _plain(t, written).prompt_ids == g.prompt_ids
    if name == "gemma3":  # Gemma 3's own ids: BOS 2, spelt "<bos>"
        assert bos == 2 and t.bos_token == "<bos>" and len(t) == 262144


def test_single_turn_group_and_masks(tok):
    async def script(text, k, seed):
        return "a" * (k + 1)

    backend = ScriptedBackend(tok, script)
    groups = run(
        gen.generate_groups(
            [{"prompt": [{"role": "user", "content": "hi"}]}],  # conversational: the chat template
            [7],
            servers=one_server(backend, version=4),
            tokenizer=tok,
            generation=GenerationConfig(group_size=3, max_tokens=8),
            seed=1,
        )
    )
    (g,) = groups
    assert g.group_id == "train-00000007" and len(g.completions) == 3 and len(backend.requests) == 1
    assert tok.decode(g.prompt_ids).endswith("<|im_start|>assistant\n")
    for k, c in enumerate(g.completions):
        assert c.completion_ids[:-1] == tok.encode("a" * (k + 1), add_special_tokens=False)
        assert c.completion_mask == [1] * len(c.completion_ids) and len(c.logprobs) == len(c.completion_ids)
        assert c.messages[0].content == "a" * (k + 1) and c.policy_version == c.policy_version_end == 4
        # rewards see the text without the EOS marker the model stopped with (as TRL decodes it)
        assert c.completion == "a" * (k + 1) and c.finish_reason == "stop"


def test_multi_turn_trajectory_masks_and_logprobs_align(tok):
    def add(a: int, b: int) -> int:
        """Add two numbers.

        Args:
            a: first
            b: second
        """
        return a + b

    async def script(text, k, seed):
        return call("add", a=2, b=3) if text.count("<tool_response>") == 0 else "the answer is 5"

    backend = ScriptedBackend(tok, script)
    (g,) = run(
        gen.generate_groups(
            [{"prompt": "add 2 and 3"}],
            [0],
            servers=one_server(backend),
            tokenizer=tok,
            generation=GenerationConfig(group_size=1, max_tokens=64, max_turns=3),
            tools=ToolsConfig(tools=[add]),
        )
    )
    c = g.completions[0]
    # trajectory: assistant call, tool result, assistant answer; the prompt is not repeated
    assert [(m.role, m.is_completion) for m in c.messages] == [
        ("assistant", True),
        ("tool", False),
        ("assistant", True),
    ]
    assert c.messages[1].content == "5" and c.tool_calls[0].result == "5" and not c.tool_calls[0].failed
    assert "add 2 and 3" not in c.completion and c.completion.count("<tool_call>") == 1
    # the full sequence is exactly what a fresh render of the conversation gives
    convo = [
        {"role": "user", "content": "add 2 and 3"},
        {"role": "assistant", "content": call("add", a=2, b=3)},
        {"role": "tool", "content": "5"},
        {"role": "assistant", "content": "the answer is 5"},
    ]
    expected = tok.apply_chat_template(convo, tools=[tool_schema(add)], tokenize=False)
    assert tok.decode(g.prompt_ids + c.completion_ids) + "\n" == expected
    # mask-1 positions are exactly the generated tokens, and their logprobs line up one to one
    generated = [t for turn in c.turns for t in turn.output_ids]
    assert [i for i, m in zip(c.completion_ids, c.completion_mask, strict=True) if m] == generated
    assert [lp for lp, m in zip(c.logprobs, c.completion_mask, strict=True) if m] == [
        lp for turn in c.turns for lp in turn.logprobs
    ]
    assert all(lp == 0.0 for lp, m in zip(c.logprobs, c.completion_mask, strict=True) if not m)
    assert not c.truncated and c.num_turns == 2


def test_max_turns_truncates(tok):
    def ping() -> str:
        """Ping."""
        return "pong"

    async def script(text, k, seed):
        return call("ping")

    (g,) = run(
        gen.generate_groups(
            [{"prompt": "p"}],
            [0],
            servers=one_server(ScriptedBackend(tok, script)),
            tokenizer=tok,
            generation=GenerationConfig(group_size=2, max_tokens=64, max_turns=3),
            tools=ToolsConfig(tools=[ping]),
        )
    )
    for c in g.completions:
        assert (
            c.truncated and c.truncation_reason == "max_turns" and c.num_turns == 3 and len(c.tool_calls) == 2
        )


def test_every_tool_failure_is_recorded_and_the_rollout_goes_on(tok):
    def boom(x: int) -> int:
        """Fails.

        Args:
            x: anything
        """
        raise RuntimeError("kaput")

    async def hang() -> str:
        """Never returns."""
        await asyncio.sleep(30)
        return "late"

    bad_calls = [
        "<tool_call>{not json</tool_call>",
        call("nope"),
        call("boom", y=1),
        call("boom", x=1),
        call("hang"),
    ]

    async def script(text, k, seed):
        n = text.count("<tool_response>")
        return bad_calls[n] if n < len(bad_calls) else "done"

    (g,) = run(
        gen.generate_groups(
            [{"prompt": "p"}],
            [0],
            servers=one_server(ScriptedBackend(tok, script, 8192)),
            tokenizer=tok,
            generation=GenerationConfig(group_size=1, max_tokens=64, max_turns=10, max_rollout_tokens=4000),
            tools=ToolsConfig(tools=[boom, hang], tool_timeout_s=0.3),
        )
    )
    c = g.completions[0]
    errors = [tc.error for tc in c.tool_calls]
    assert all(tc.failed for tc in c.tool_calls) and len(errors) == 5
    assert "malformed tool call JSON" in errors[0] and "unknown tool 'nope'" in errors[1]
    assert "wrong arguments for boom" in errors[2] and "RuntimeError: kaput" in errors[3]
    assert "timed out after 0.3s" in errors[4]
    assert c.messages[-1].content == "done" and not c.truncated  # the rollout went on to the end


def test_slow_sync_tool_does_not_block_other_rollouts(tok):
    finished: list[str] = []
    fast_finished, waited = threading.Event(), []

    def slow() -> str:
        """Returns once the other rollout has got its tool's answer."""
        # blocking the event loop would hold that answer back: 8 s (under the tool timeout) then fails
        waited.append(fast_finished.wait(8))
        return "slow done"

    def fast() -> str:
        """Returns at once."""
        return "fast done"

    async def script(text, k, seed):
        if "<tool_response>" in text:
            finished.append("slow" if "slow done" in text else "fast")
            if finished[-1] == "fast":
                fast_finished.set()
            return "ok"
        return call("slow") if "use slow" in text else call("fast")

    rows = [{"prompt": "use slow"}, {"prompt": "use fast"}]
    run(
        gen.generate_groups(
            rows,
            [0, 1],
            servers=one_server(ScriptedBackend(tok, script)),
            tokenizer=tok,
            generation=GenerationConfig(group_size=1, max_tokens=64, max_turns=2),
            tools=ToolsConfig(tools=[slow, fast]),
        )
    )
    # the fast rollout finished while the slow tool was still running in its thread
    assert finished == ["fast", "slow"] and waited == [True]


def test_token_budget_and_max_model_len(tok):
    async def script(text, k, seed):
        return "x" * 50

    backend = ScriptedBackend(tok, script, max_len=120)
    (g,) = run(
        gen.generate_groups(
            [{"prompt": "p" * 40}],
            [0],
            servers=one_server(backend),
            tokenizer=tok,
            generation=GenerationConfig(group_size=2, max_tokens=100, max_rollout_tokens=30),
        )
    )
    assert all(r["prompt_len"] + r["max_tokens"] <= 120 for r in backend.requests)
    assert all(len(c.completion_ids) <= 30 and c.truncation_reason == "max_tokens" for c in g.completions)
    (g,) = run(
        gen.generate_groups(
            [{"prompt": "p" * 200}],
            [0],
            servers=one_server(backend),
            tokenizer=tok,
            generation=GenerationConfig(group_size=2, max_tokens=10),
        )
    )
    assert all(c.truncation_reason == "prompt_too_long" and c.completion_ids == [] for c in g.completions)


def test_row_without_prompt_is_named(tok):
    with pytest.raises(ValueError, match="row 5 has no 'prompt'"):
        run(
            gen.generate_groups(
                [{"q": 1}],
                [5],
                servers=one_server(ScriptedBackend(tok, None)),
                tokenizer=tok,
                generation=GenerationConfig(group_size=2, max_tokens=4),
            )
        )


def _counter_script():
    # Sample k of every group calls increment k+1 times (with by=1), then stops. Sleeps interleave
    # the rollouts so environment slots are shared over time.
    async def script(text, k, seed):
        calls = text.count("<tool_response>")
        prompt_index = 1 if "count more" in text else 0
        sample = (seed - prompt_index * 10_007 - calls) // 101  # inverse of sample_seed with base seed 0
        await asyncio.sleep(0.001 * (sample % 3))
        return call("increment", by=1) if calls < sample + 1 else "finished"

    return script


def _counter_groups(tok):
    return run(
        gen.generate_groups(
            [{"prompt": "count"}, {"prompt": "count more"}],
            [0, 1],
            servers=one_server(ScriptedBackend(tok, _counter_script(), 8192)),
            tokenizer=tok,
            generation=GenerationConfig(group_size=4, max_tokens=64, max_turns=8, max_rollout_tokens=8000),
            tools=ToolsConfig(environment=CounterEnv, env_slots=3),
            seed=0,
        )
    )


def test_environment_snapshots_keep_each_completions_own_state(tok):
    groups = _counter_groups(tok)
    for g in groups:
        for c in g.completions:
            own = sum(1 for tc in c.tool_calls if tc.name == "increment" and not tc.failed)
            assert own == c.sample_index + 1
            assert c.environment.get_reward() == own  # the snapshot, not the reused slot
    assert "A counter starts at 0" in groups[0].prompt  # reset()'s text is appended to the prompt


def test_without_snapshots_rewards_leak_between_completions(tok, monkeypatch):
    """Removing the snapshot makes the previous test's property fail: slots are reused and reset."""
    monkeypatch.setattr("grpoflow.tasks.rollouts.multi_turn.snapshot", lambda env: env)
    groups = _counter_groups(tok)
    mismatched = [
        c for g in groups for c in g.completions if c.environment.get_reward() != c.sample_index + 1
    ]
    assert mismatched


def test_hermes_parser_handles_several_calls_and_string_arguments():
    text = call("a", x=1) + " and " + '<tool_call>{"name": "b", "arguments": "{\\"y\\": 2}"}</tool_call>'
    calls = HermesToolParser().parse(text)
    assert [(c.name, c.arguments) for c in calls] == [("a", {"x": 1}), ("b", {"y": 2})]


def test_each_completion_is_trained_and_scored_on_its_own_prompt(tok):
    """An environment whose reset note differs per sample: the learner's input, the rollouts row and
    the `prompts` a reward function receives are each completion's own prompt."""
    from grpoflow.storage.tables import rollout_rows
    from grpoflow.tasks.config.rewards import RewardConfig
    from grpoflow.tasks.learner.learner_api import samples_from_groups
    from grpoflow.tasks.rewards.score import score_groups
    from tests.unit.envs import TargetEnv

    async def script(text, k, seed):
        return "done"

    TargetEnv.draws = 0
    (g,) = run(
        gen.generate_groups(
            [{"prompt": "reach the target"}],
            [0],
            servers=one_server(ScriptedBackend(tok, script)),
            tokenizer=tok,
            generation=GenerationConfig(group_size=3, max_tokens=16, max_turns=2),
            tools=ToolsConfig(environment=TargetEnv, env_slots=2),
        )
    )
    notes = [f"Your target is {c.environment.target}." for c in g.completions]
    assert len(set(notes)) == 3
    seen: list = []

    def record_prompts(prompts, completions, **_):
        seen.extend(prompts)
        return [1.0] * len(completions)

    score_groups([g], [RewardConfig(name="seen", fn=record_prompts)])
    assert seen == [f"reach the target\n\n{n}" for n in notes]
    for c in g.completions:
        c.trained, c.advantage = True, 1.0
    rows = rollout_rows([g], run_id="r", step=0)
    for s, row, note in zip(samples_from_groups([g]), rows, notes, strict=True):
        own = tok.decode(s.input_ids[: s.prompt_len])
        assert note in own and sum(n in own for n in notes) == 1
        assert s.input_ids[: s.prompt_len] == list(row["prompt_ids"]) and note in row["prompt"]


def test_snapshots_are_isolated_and_a_timed_out_slot_is_never_reused(tok):
    """One pooled slot for three rollouts, list state, and a tool that hangs past its timeout and then
    writes to the instance it was bound to. Every snapshot holds exactly its own rollout's items."""
    from tests.unit.envs import ListEnv

    ListEnv.release.clear()
    ListEnv.wrote.clear()

    async def script(text, k, seed):
        sample = (seed - text.count("<tool_response>")) // 101  # inverse of sample_seed, base seed 0
        calls = text.count("<tool_response>")
        if sample == 0:
            return call("hang") if calls == 0 else "done"
        if calls == 0:
            ListEnv.release.set()  # the hung call of sample 0 now writes to its instance...
            # ...while this rollout holds the slot (if it was reused); 30 s: a write that never comes fails
            assert await asyncio.to_thread(ListEnv.wrote.wait, 30), "the hung call never wrote"
            return call("put", item=f"s{sample}")
        return "done"

    (g,) = run(
        gen.generate_groups(
            [{"prompt": "fill"}],
            [0],
            servers=one_server(ScriptedBackend(tok, script)),
            tokenizer=tok,
            generation=GenerationConfig(group_size=3, max_tokens=64, max_turns=3),
            tools=ToolsConfig(environment=ListEnv, env_slots=1, tool_timeout_s=0.2),
            seed=0,
        )
    )
    c0, c1, c2 = g.completions
    assert c0.tool_calls[0].failed and "timed out" in c0.tool_calls[0].error
    assert c0.environment.items == []
    assert c1.environment.items == ["s1"] and c2.environment.items == ["s2"]


def test_environment_that_cannot_snapshot_fails_preflight_naming_the_fix():
    from grpoflow.flows.config import ConfigError, GRPOConfig
    from grpoflow.flows.training.environments import check_run

    cfg = GRPOConfig.model_validate({"tools": {"environment": "tests.unit.envs:LockedEnv"}})
    with pytest.raises(ConfigError, match=r"tools.environment: .*cannot be deep-copied.*snapshot\(\)"):
        check_run(cfg)
    letter = [{"name": "letter", "fn": "grpoflow.examples.rewards:letter_fraction"}]
    ok = GRPOConfig.model_validate(
        {"tools": {"environment": "tests.unit.envs:LockedEnvWithSnapshot"}, "rewards": letter}
    )
    check_run(ok)  # its own snapshot() is the contract


def test_own_snapshot_method_is_used_and_is_not_a_tool():
    from grpoflow.tasks.rollouts.tools import environment_tools
    from tests.unit.envs import LockedEnvWithSnapshot

    env = LockedEnvWithSnapshot()
    env.count = 3
    assert snapshot(env) == {"count": 3}
    assert "snapshot" not in environment_tools(env)


def test_every_request_carries_the_cache_salt_of_the_weights_it_runs_under(tok):
    """After a push, no request may be served from prefix-cache KV of older weights: each request
    (each turn of a multi-turn rollout too) is salted with its version's salt, renewed by the push."""
    from grpoflow.tasks.rollouts.cache_salt import cache_salt_for, renew_cache_salt

    async def script(text, k, seed):
        return call("ping") if "pong" not in text else "done"

    backend = ScriptedBackend(tok, script)
    servers = one_server(backend, version=3)

    def ping() -> str:
        """Ping."""
        servers.replicas.replicas[0].versions.set(4)  # a push lands while the rollout waits for its tool
        renew_cache_salt(4)
        return "pong"

    run(
        gen.generate_groups([{"prompt": "p"}], [0], servers=servers, tokenizer=tok, generation=GenerationConfig(group_size=1, max_tokens=64, max_turns=3), tools=ToolsConfig(tools=[ping]))
    )  # fmt: skip
    salts = [r["cache_salt"] for r in backend.requests]
    assert salts == [cache_salt_for(3), cache_salt_for(4)] and salts[0] != salts[1]
    single = ScriptedBackend(tok, script)
    run(gen.generate_groups([{"prompt": "q"}], [1], servers=one_server(single, version=4), tokenizer=tok, generation=GenerationConfig(group_size=2, max_tokens=4)))  # fmt: skip
    assert [r["cache_salt"] for r in single.requests] == [cache_salt_for(4)]


def test_a_tool_raising_timeout_error_itself_is_a_failure_not_a_timeout():
    from grpoflow.tasks.rollouts.tools import ParsedCall

    def gives_up() -> str:
        """Its own HTTP client gave up."""
        raise TimeoutError("upstream took too long")

    async def gives_up_async() -> str:
        """The same, async."""
        raise TimeoutError("upstream took too long")

    for fn in (gives_up, gives_up_async):
        box = toolbox(fn, timeout_s=5.0)
        rec = run(box.call(ParsedCall(fn.__name__, {}, "{}"), turn=0))
        assert rec.failed and rec.error == "TimeoutError: upstream took too long" and not box.timed_out
        assert rec.node == __import__("socket").gethostname()  # ran here (no Ray): this host
    unknown = run(box.call(ParsedCall("nope", {}, "{}"), turn=0))
    assert unknown.failed and unknown.node == ""  # never ran anywhere
    slow = toolbox(lambda: __import__("time").sleep(5), timeout_s=0.2)
    rec = run(slow.call(ParsedCall("<lambda>", {}, "{}"), turn=0))
    assert rec.error == "tool <lambda> timed out after 0.2s" and slow.timed_out

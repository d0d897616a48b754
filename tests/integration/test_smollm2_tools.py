"""SmolLM2-135M-Instruct through a real vLLM server started for it, with its own tokenizer, chat
template and the calculator tool (configs/smollm2-tools.yaml as shipped, warm-up included, for two
short steps): a template, tokenizer or tool-call parser regression on a real model fails here. It
asserts mechanics (parsed calls, aligned masks, stored rows), never learning; benchmarks and
BENCHMARKS.md cover that. Then the same config trained again on the same server is the same run bit
for bit. One SmolLM2 server, started as a run starts its embedded one, serves both runs (each loads
its weights into it first, as with any external server): a second server would cost the suite a
minute."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from grpoflow.flows.config import load_config
from grpoflow.storage.sql import query

pytestmark = [pytest.mark.integration, pytest.mark.memory_heavy]

REPO = Path(__file__).resolve().parents[2]
STEPS, PROMPTS, G = 2, 4, 4


@pytest.fixture(scope="module")
def smollm2_model_dir():
    """The model `make models/smollm2-135m` converts (`make test` runs that target first)."""
    model = REPO / "models" / "smollm2-135m"
    if not (model / "config.json").is_file():
        pytest.fail(f"no SmolLM2 model at {model}: run `make models/smollm2-135m` (make test does)")
    return model


@pytest.mark.slow
def test_smollm2_tool_rollouts_parse_align_store_and_reproduce(tmp_path, smollm2_model_dir, prefect_api):
    from grpoflow.flows.processes.serve import start_server

    config = REPO / "configs" / "smollm2-tools.yaml"
    sets = [f"storage.root={tmp_path}", f"model.path={smollm2_model_dir}", f"run.steps={STEPS}",
            f"data.prompts_per_step={PROMPTS}", f"generation.group_size={G}"]  # fmt: skip
    inference = load_config(config).inference
    server = start_server(smollm2_model_dir, max_model_len=inference.max_model_len, kv_cache_gb=inference.kv_cache_gb,
                          log_path=tmp_path / "vllm.log", startup_timeout_s=600)  # fmt: skip
    sets.append(f"inference.url={server.url}")
    try:
        _train_and_check(config, sets, smollm2_model_dir, tmp_path)
    finally:
        server.stop()


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

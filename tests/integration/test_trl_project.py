"""A TRL project's run on the real vLLM server: a TRL-style reward on a conversational Hugging Face
dataset (data.dataset through datasets.load_dataset), given as text, fails on every completion; the run
says so at once, stops after run.max_failed_reward_steps with one `error:` line that says to set
`completions: messages`, and `--resume` with that set finishes it with every table exactly once. A
local sequence-classification reward model (`rewards[].model`) scores beside it, as calling it by hand
does. A reward with no value for any completion (invalid, nothing failed) stops a run the same way."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from grpoflow.storage.rollouts import RolloutStore
from grpoflow.storage.sql import query
from tests.support import REPO, assistant_text, by_hand, save_reward_model

pytestmark = pytest.mark.integration

STEPS, PROMPTS, G = 4, 2, 4
QUESTIONS = [f"What is {a} + {b}?" for a, b in ((2, 3), (4, 4), (1, 6), (7, 2))]


@pytest.mark.slow
def test_a_broken_trl_reward_stops_the_run_loudly_and_resumes_once_fixed(
    tmp_path, vllm_server, tiny_model_dir, prefect_api
):
    from prefect.settings import PREFECT_API_URL
    from transformers import AutoTokenizer

    data = tmp_path / "math.jsonl"
    data.write_text("".join(
        json.dumps({"prompt": [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": q}],
                    "solution": str(eval(q[8:-1]))}) + "\n"
        for q in QUESTIONS
    ))  # fmt: skip
    rm = save_reward_model(tmp_path / "rm", AutoTokenizer.from_pretrained(tiny_model_dir), seed=1)

    def rewards(form: str) -> str:
        return (f"rewards=[{{name: docs, fn: 'tests.unit.reward_fns:trl_docs_length', completions: {form}}}, "
                f"{{name: rm, model: '{rm}', batch_size: 3}}]")  # fmt: skip

    sets = [f"storage.root={tmp_path}", f"model.path={tiny_model_dir}", f"inference.url={vllm_server.url}",
            f"run.steps={STEPS}", "run.checkpoint_every=1", "run.max_failed_reward_steps=2",
            f"data.dataset={{path: json, data_files: '{data}'}}", f"data.prompts_per_step={PROMPTS}",
            f"generation.group_size={G}", "algorithm.max_staleness=0"]  # fmt: skip

    def train(reward_sets: str, *args: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-m", "grpoflow.flows.cli.main", "train", *args, *[a for s in [*sets, reward_sets] for a in ("--set", s)]],
            cwd=REPO, capture_output=True, text=True, timeout=600,
            env={**os.environ, "PREFECT_API_URL": str(PREFECT_API_URL.value())},
        )  # fmt: skip

    out = train(rewards("text"), "--run-id", "trl")
    assert out.returncode == 1, out.stderr[-3000:]
    errors = [line for line in out.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, out.stderr[-3000:]
    assert errors[0].startswith("error: reward 'docs' failed on every completion of steps 0-1"), errors[0]
    assert "TypeError: string indices must be integers" in errors[0]
    assert "set rewards[0].completions: messages" in errors[0] and errors[0].endswith("--resume trl")
    # each broken step was said as its batch was scored: the reward, the share, the first traceback
    said = out.stderr[: out.stderr.index(errors[0])]
    assert f"step 0: reward 'docs' failed on {PROMPTS * G}/{PROMPTS * G} completions" in said
    assert "Traceback" in said and 'c[0]["content"]' in said
    assert said.count("nothing trained  failed: docs 100%") == 2  # both steps' lines, then the error
    assert RolloutStore(tmp_path).read_run_meta("trl")["status"] == "failed"

    fixed = train(rewards("messages"), "--resume", "trl")
    assert fixed.returncode == 0, fixed.stderr[-3000:]

    # Every table exactly once: step 0 as it ran broken (checkpointed), steps 1-3 after the fix.
    _, rows = query(
        tmp_path, "SELECT step, count(*) FROM rollouts WHERE run_id = 'trl' GROUP BY step ORDER BY step"
    )
    assert rows == [(s, PROMPTS * G) for s in range(STEPS)]
    _, rows = query(tmp_path, "SELECT step, reward_name, status, count(*) FROM rewards WHERE run_id = 'trl' "
                              "GROUP BY ALL ORDER BY step, reward_name")  # fmt: skip
    assert rows == [(0, "docs", "failed", PROMPTS * G), (0, "rm", "valid", PROMPTS * G)] + [
        (s, name, "valid", PROMPTS * G) for s in range(1, STEPS) for name in ("docs", "rm")
    ]
    # its log_metric: each step's mean length of the assistant messages it read (the text as generated)
    _, rows = query(tmp_path, "SELECT step, \"reward/docs/mean_chars\" FROM steps WHERE run_id = 'trl' ORDER BY step")  # fmt: skip
    assert [s for s, _ in rows] == list(range(STEPS)) and rows[0][1] is None
    tiny = AutoTokenizer.from_pretrained(tiny_model_dir)
    for step, mean in rows[1:]:
        _, ids = query(
            tmp_path, f"SELECT completion_ids FROM rollouts WHERE run_id = 'trl' AND step = {step}"
        )
        chars = [len(assistant_text(tiny, i)) for (i,) in ids]
        assert mean == pytest.approx(sum(chars) / len(chars))

    # The reward model's cells are what the model says of the prompt (its chat template) + completion.
    _, cells = query(tmp_path, "SELECT r.prompt, r.completion, w.value FROM rollouts r JOIN rewards w USING "
                               "(run_id, step, group_id, sample_index) WHERE w.reward_name = 'rm' AND r.step = 2")  # fmt: skip
    tok = AutoTokenizer.from_pretrained(rm)
    texts, values = [], []
    for prompt, completion, value in cells:
        (q,) = [q for q in QUESTIONS if q in prompt]
        msgs = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": q},
                {"role": "assistant", "content": completion}]  # fmt: skip
        texts.append(tok.apply_chat_template(msgs, tokenize=False))
        values.append(value)
    assert values == pytest.approx(by_hand(rm, texts), abs=1e-4)


def test_a_run_whose_every_completion_is_masked_stops_loudly_and_resumes(
    tmp_path, vllm_server, tiny_model_dir, prefect_api
):
    """Nothing failed, but no completion has a valid value of its required reward: the run trains
    nothing, so after run.max_failed_reward_steps such steps it stops in one `error:` line naming the
    reward and the reason, exit 1, and --resume with a reward that scores finishes it."""
    from prefect.settings import PREFECT_API_URL

    sets = [f"storage.root={tmp_path}", f"model.path={tiny_model_dir}", f"inference.url={vllm_server.url}",
            "run.steps=3", "run.checkpoint_every=1", "run.max_failed_reward_steps=2", "data.prompts_per_step=2",
            "generation.group_size=4", "generation.max_tokens=8", "algorithm.max_staleness=0"]  # fmt: skip

    def train(fn: str, *args: str) -> subprocess.CompletedProcess:
        reward = f"rewards=[{{name: manners, fn: '{fn}'}}]"
        return subprocess.run(
            [sys.executable, "-m", "grpoflow.flows.cli.main", "train", *args, *[a for s in [*sets, reward] for a in ("--set", s)]],
            cwd=REPO, capture_output=True, text=True, timeout=600,
            env={**os.environ, "PREFECT_API_URL": str(PREFECT_API_URL.value())},
        )  # fmt: skip

    out = train("tests.unit.reward_fns:judged_elsewhere", "--run-id", "quiet")
    assert out.returncode == 1, out.stderr[-3000:]
    errors = [line for line in out.stderr.splitlines() if line.startswith("error: ")]
    assert errors == [
        "error: every completion of steps 0-1 was masked, no valid value of every required reward "
        "(run.max_failed_reward_steps=2): reward 'manners' invalid on 8/8: returned None; nothing was "
        "trained. Fix it and continue the run with --resume quiet"
    ], out.stderr[-3000:]
    said = out.stderr[: out.stderr.index(errors[0])]  # each step said as its batch was scored
    assert "step 0: every completion (8) was masked: reward 'manners' invalid on 8/8: returned None" in said
    store = RolloutStore(tmp_path)
    assert store.read_run_meta("quiet")["status"] == "failed"
    assert store.steps_written("steps", "quiet") == [0, 1]  # step 1's row, not its checkpoint

    fixed = train("tests.unit.reward_fns:length", "--resume", "quiet")
    assert fixed.returncode == 0, fixed.stderr[-3000:]
    _, rows = query(
        tmp_path,
        "SELECT step, status, count(*) FROM rewards WHERE run_id = 'quiet' GROUP BY ALL ORDER BY step",
    )
    assert rows == [(0, "invalid", 8), (1, "valid", 8), (2, "valid", 8)]  # step 1 redone with the fix

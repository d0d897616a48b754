"""Bad input to `grpoflow train`: one clear error naming the field, row or path, before any model is
loaded (torch and transformers are not even imported) and before anything is written to the store."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]

# One process imports the CLI once and forks a child per command (19 fresh interpreters took 60-100 s of
# CI's unit tier): each child starts from the same modules, none heavy, as a fresh `grpoflow` would.
FORKS = """
import json, os, sys
from grpoflow.flows.cli.main import main
for line in sys.stdin:
    args, out = json.loads(line)
    pid = os.fork()
    if pid == 0:
        os.dup2(os.open(out + ".err", os.O_WRONLY | os.O_CREAT), 2)
        os.dup2(os.open(out + ".out", os.O_WRONLY | os.O_CREAT), 1)
        try:
            rc = main(args)
        except SystemExit as e:
            rc = e.code
        heavy = sorted(m for m in ("torch", "transformers", "vllm") if m in sys.modules)
        sys.stdout.flush(), sys.stderr.flush()
        with open(out + ".rc", "w") as f:
            json.dump([rc, ",".join(heavy) or "-"], f)
        os._exit(0)
    _, status = os.waitpid(pid, 0)
    print(json.dumps(status), flush=True)
"""


@pytest.fixture(scope="module")
def _forks():
    proc = subprocess.Popen(
        [sys.executable, "-c", FORKS],
        cwd=REPO,
        env={**os.environ, "PREFECT_API_URL": "http://127.0.0.1:9/api"},  # never contacted
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    yield proc
    proc.stdin.close()
    proc.wait(60)


@pytest.fixture
def train(_forks, tmp_path):
    """`grpoflow train --root ROOT ARGS...` in a child of `_forks`: (exit status, heavy modules, stderr)."""

    def run(root: Path, *args: str) -> tuple[int, str, str]:
        out = str(tmp_path / "cli")
        _forks.stdin.write(json.dumps([["train", "--root", str(root), *args], out]) + "\n")
        _forks.stdin.flush()
        status = json.loads(_forks.stdout.readline())
        err = Path(out + ".err").read_text()
        assert status == 0, (status, err)
        rc, heavy = json.loads(Path(out + ".rc").read_text())
        return rc, heavy, err

    return run


def _jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def cases(tmp: Path) -> dict[str, tuple[list[str], str]]:
    no_tok = tmp / "model-without-tokenizer"
    no_tok.mkdir()
    (no_tok / "config.json").write_text("{}")
    missing_reward = tmp / "missing-reward.yaml"
    missing_reward.write_text(
        "data: {generator: 'grpoflow.examples.envs:letters_rows'}\nrewards:\n  - name: r\n    fn: grpoflow.examples.rewards:no_such_reward\n"
    )
    causal = tmp / "causal-lm"
    causal.mkdir()
    (causal / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    (causal / "tokenizer.json").write_text("{}")
    rows = _jsonl(tmp / "conv.jsonl", [{"prompt": [{"role": "user", "content": "hi"}]}])
    return {
        "unknown completions form": (
            [
                "--set",
                "rewards=[{name: r, fn: 'grpoflow.examples.rewards:letter_fraction', completions: chat}]",
            ],
            "rewards.0.completions",
        ),
        "reward with neither fn nor model": (["--set", "rewards=[{name: r}]"], "set exactly one of fn"),
        "reward model that is no classifier": (
            ["--set", f"rewards=[{{name: rm, model: '{causal}'}}]"],
            "rewards[0].model: "
            + f"{causal} is not a sequence-classification model (architectures: LlamaForCausalLM)",
        ),
        "dataset split that does not exist": (
            ["--set", f"data.dataset={{path: json, data_files: '{rows}', split: test}}"],
            "data.dataset.split: no split 'test'",
        ),
        "malformed value": (["--set", "generation.group_size=1"], "generation.group_size"),
        "wrong type": (["--set", "learner.lr=fast"], "learner.lr"),
        "missing reward import": (
            ["--config", str(missing_reward)],
            "grpoflow.examples.rewards:no_such_reward",
        ),
        "row without prompt": (
            ["--set", f"data.path={_jsonl(tmp / 'rows.jsonl', [{'prompt': 'hi'}, {'question': 'x'}])}"],
            "row 1 has no 'prompt'",
        ),
        "empty dataset": (["--set", f"data.path={_jsonl(tmp / 'empty.jsonl', [])}"], "dataset is empty"),
        "model dir without tokenizer": (["--set", f"model.path={no_tok}"], f"{no_tok} has no tokenizer"),
        "run id escaping the root": (["--run-id", "../outside"], "run.run_id"),
        "resume id escaping the root": (["--resume", "../../etc"], "--resume: invalid run id"),
        "resume of an unknown run": (["--resume", "ghost"], "--resume: no run 'ghost'"),
        "lora rank 0": (["--set", "learner.lora={rank: 0}"], "learner.lora.rank"),
        "merged adapters without lora": (["--set", "sync.backend=lora_merged"], "learner.lora is not set"),
        "eval during training without an eval split": (
            ["--set", "run.eval_every=5"],
            "run.eval_every 5 needs a held-out split to score: set data.eval_path, data.eval_fraction",
        ),
        "eval between pushes": (
            [
                *("--set", "run.eval_every=3", "--set", "sync.sync_every=2"),
                *("--set", "data.eval_fraction=0.2", "--set", "algorithm.max_staleness=1"),
            ],
            "run.eval_every 3 must be a multiple of sync.sync_every 2",
        ),
        "eval split with no rows": (
            ["--set", "run.eval_every=5", "--set", f"data.eval_path={_jsonl(tmp / 'no-eval.jsonl', [])}"],
            "data.eval_path",
        ),
        "unknown tracker": (["--set", "run.report_to=[comet]"], "run.report_to.0"),
    }


@pytest.mark.parametrize(
    "case",
    [
        "malformed value",
        "wrong type",
        "missing reward import",
        "row without prompt",
        "empty dataset",
        "model dir without tokenizer",
        "run id escaping the root",
        "resume id escaping the root",
        "resume of an unknown run",
        "lora rank 0",
        "merged adapters without lora",
        "unknown completions form",
        "reward with neither fn nor model",
        "reward model that is no classifier",
        "dataset split that does not exist",
        "eval during training without an eval split",
        "eval between pushes",
        "eval split with no rows",
        "unknown tracker",
    ],
)
def test_bad_input_fails_early_and_writes_nothing(case, tmp_path, train):
    args, named = cases(tmp_path)[case]
    root = tmp_path / "store"
    rc, heavy, err = train(root, *args)
    assert rc == 2
    assert err.startswith("error: ") and named in err, err
    assert "Traceback" not in err
    assert heavy == "-"  # no model was (or could have been) loaded
    assert not root.exists()  # nothing written to the store


def test_lora_target_modules_the_model_lacks_fail_before_any_server_or_file(tmp_path, train):
    from grpoflow.tasks.tiny_model import build_tiny_model

    model = build_tiny_model(tmp_path / "tiny")
    root = tmp_path / "store"
    rc, _, err = train(
        root, "--set", f"model.path={model}", "--set", "learner.lora={target_modules: [q_proj, qkv]}"
    )
    assert rc == 2 and "Traceback" not in err
    assert err.startswith("error: learner.lora.target_modules: ['qkv'] name no linear layer"), err
    assert len(err.strip().splitlines()) == 1
    assert not root.exists()

"""What test modules share, so that none imports another: waiting on a condition, and the data,
configs and projects that several tiers build."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

from grpoflow.storage.records import (
    RewardCell,
    RolloutCompletion,
    RolloutGroup,
    TaggedMessage,
    ToolCallRecord,
    TurnRecord,
)

if TYPE_CHECKING:
    from grpoflow.tasks.learner.learn import Learner

REPO = Path(__file__).resolve().parents[1]
T = TypeVar("T")


def need_browser(*programs: str) -> None:
    """Skip a browser test where Debian's `programs` (chromium, chromedriver) are missing; fail it in
    CI (`CI` set), where .ci/run installs them, so that a missing browser cannot pass CI unseen."""
    import os
    import shutil

    import pytest

    missing = [p for p in programs if shutil.which(p) is None]
    if missing:
        why = f"Debian's {' and '.join(missing)} not installed (.ci/run installs them)"
        if os.environ.get("CI", "").lower() not in ("", "0", "false", "no"):
            pytest.fail(f"{why}; CI runs every browser test")
        pytest.skip(why)


def need_netns() -> None:
    """Skip a test of tests/hosts.py's Hosts where they cannot run (not root, no `ip` or `unshare`, no
    namespaces allowed); fail it in CI (`CI` set) instead, so that those tests cannot go unrun unseen."""
    import os
    import shutil
    import subprocess

    import pytest

    why = None
    if os.geteuid() != 0:
        why = "needs root (network namespaces, a bridge)"
    elif missing := [p for p in ("ip", "unshare", "sh") if shutil.which(p) is None]:
        why = f"{' and '.join(missing)} not installed"
    elif subprocess.run(["unshare", "--net", "--mount", "true"], capture_output=True).returncode:
        why = "cannot make network and mount namespaces here (a container without CAP_SYS_ADMIN?)"
    elif subprocess.run(["ip", "netns", "list"], capture_output=True).returncode:
        why = "`ip netns` does not work here"
    if why:
        if os.environ.get("CI", "").lower() not in ("", "0", "false", "no"):
            pytest.fail(f"{why}; CI runs the hosts tests")
        pytest.skip(why)


def hosts_fixture(n: int, *, prefix: str = "gf", scope: str = "function"):
    """A pytest fixture of `n` started tests.hosts.Hosts (need_netns first), torn down after it:
    `two_hosts = hosts_fixture(2)` in a test module."""
    import pytest

    from tests.hosts import Hosts

    @pytest.fixture(scope=scope)
    def fixture():
        need_netns()
        with Hosts(n, prefix=prefix) as hosts:
            yield hosts

    return fixture


def wait_for(
    condition: Callable[[], T],
    timeout_s: float,
    what: str,
    interval_s: float = 0.1,
    why: Callable[[], str] | None = None,
) -> T:
    """Poll `condition` until it returns something truthy, and return that; fail naming `what` (and what
    `why` says then, e.g. a log's tail) once `timeout_s` seconds have passed. `condition` may raise
    AssertionError itself to fail early (a process it depends on exited)."""
    deadline = time.monotonic() + timeout_s
    while not (value := condition()):
        if time.monotonic() > deadline:
            detail = f"\n{why()}" if why is not None else ""
            raise AssertionError(f"timed out after {timeout_s:g} s waiting for {what}{detail}")
        time.sleep(interval_s)
    return value


def make_groups(n_groups: int = 2, size: int = 3) -> list[RolloutGroup]:
    """Groups whose completion i is "a" * (i + 1): a length reward scores them 1, 2, 3, ..."""
    return [
        RolloutGroup(
            group_id=f"g{g}",
            prompt_index=g,
            prompt=f"<prompt {g}>",
            prompt_ids=[1, 2],
            completions=[
                RolloutCompletion(
                    sample_index=i,
                    completion="a" * (i + 1),
                    completion_ids=[3] * (i + 1),
                    completion_mask=[1] * (i + 1),
                    logprobs=[-1.0] * (i + 1),
                )
                for i in range(size)
            ],
            row={"prompt": f"raw {g}", "answer": g},
        )
        for g in range(n_groups)
    ]


def tiny_cfg(root: Path, model_dir: Path, url: str, **sets: object):
    """configs/tiny-letters.yaml against the server at `url`, storing under `root`, with `sets`."""
    from grpoflow.flows.config import load_config

    overrides = [
        f"storage.root={root}",
        f"model.path={model_dir}",
        f"inference.url={url}",
    ] + [f"{k}={v}" for k, v in sets.items()]
    return load_config(REPO / "configs" / "tiny-letters.yaml", overrides)


Samples = list[tuple[list[int], list[int], list[float]]]  # prompt ids, sampled ids, their logprobs


def served_samples(
    url: str,
    prompts: list[list[int]],
    *,
    model: str | None = None,
    api_key: str | None = None,
    max_tokens: int = 16,
    seed: int = 5,
) -> Samples:
    """Seeded samples of `prompts` from the server at `url` (under `model`, or its own weights),
    `seed + i` for the i-th, sent together."""
    from grpoflow.tasks.rollouts.inference import VLLMClient

    async def go() -> Samples:
        async with VLLMClient(url, api_key=api_key) as c:
            runs = [c.complete(p, max_tokens=max_tokens, seed=seed + i, ignore_eos=True, model=model)
                    for i, p in enumerate(prompts)]  # fmt: skip
            return [
                (p, ch.token_ids, ch.logprobs)
                for p, (ch,) in zip(prompts, await asyncio.gather(*runs), strict=True)
            ]

    return asyncio.run(go())


def logprob_gap(model, samples: Samples) -> float:
    """The largest difference between the served logprobs of `samples` and transformers' `model` (a
    model dir or a loaded model) on the same tokens: under 1e-3, the server serves those weights."""
    import torch
    from transformers import AutoModelForCausalLM

    if not isinstance(model, torch.nn.Module):
        model = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    worst = 0.0
    for prompt, ids, logprobs in samples:
        with torch.no_grad():
            lp = torch.log_softmax(model.eval()(torch.tensor([prompt + ids])).logits[0], -1)
        ours = lp[len(prompt) - 1 : -1].gather(-1, torch.tensor(ids)[:, None])[:, 0]
        worst = max(worst, float((ours - torch.tensor(logprobs)).abs().max()))
    return worst


def perturbed(model_dir: Path, out: Path, scale: float = 0.02) -> Path:
    """A version of the model in `model_dir` with seeded noise on every weight, as a model dir `out`."""
    import torch
    from transformers import AutoModelForCausalLM

    from grpoflow.tasks.push.weights import save_weights

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * scale)
    out.mkdir(parents=True, exist_ok=True)
    save_weights(model, out)
    return out


def reload_into(url: str, version: Path, *, plain: bool = True) -> str:
    """Load the weights in `version` into the server at `url`, paused around it: grpoflow's reload
    (server/reload.py where it applies), or vLLM's own with `plain` False; which of the two ran."""
    from grpoflow.server.protocol import RELOAD_RPC
    from grpoflow.tasks.rollouts.inference import VLLMClient

    async def go() -> str:
        async with VLLMClient(url) as c:
            await c.pause()
            try:
                answer = await c.collective_rpc(
                    RELOAD_RPC, {"weights_path": str(version), "plain": plain}, 300
                )
            finally:
                await c.resume()
            await c.reset_prefix_cache()  # no KV computed under the weights before
        (worker,) = answer["results"]
        return worker["reload"]

    return asyncio.run(go())


def reload_both_ways(url: str, version: Path, prompts: list[list[int]]) -> tuple[Samples, Samples]:
    """`served_samples` of `prompts` after grpoflow's reload of `version` into the server at `url`, then
    after vLLM's own reload of the same files (`reload_into`); grpoflow's reload after vLLM's serves its
    first samples again."""
    assert reload_into(url, version) == "plain"
    plain = served_samples(url, prompts)
    assert reload_into(url, version, plain=False) == "vllm"
    vllms = served_samples(url, prompts)
    # and grpoflow's again after vLLM's (which loads each layer into a copy of its parameters)
    assert reload_into(url, version) == "plain" and served_samples(url, prompts) == plain
    return plain, vllms


def unpause(url: str) -> None:
    """Resume the server at `url`: a run killed mid-push leaves it paused, and later tests need it."""
    from grpoflow.tasks.rollouts.inference import VLLMClient

    async def go():
        async with VLLMClient(url) as c:
            await c.resume()

    asyncio.run(go())


def server_metric(url: str, name: str, api_key: str | None = None, **labels: str) -> float:
    """The sum of vLLM's Prometheus series `name` (those with `labels`) at `url`/metrics: the server's
    own record of what it runs and received, for tests that wait on it instead of sleeping."""
    import urllib.request

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    with urllib.request.urlopen(urllib.request.Request(f"{url}/metrics", headers=headers), timeout=10) as r:
        lines = r.read().decode().splitlines()
    want = [f'{k}="{v}"' for k, v in labels.items()]
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in lines
        if line.startswith(name + "{") and all(w in line for w in want)
    )


async def until_running(url: str, api_key: str | None = None, timeout_s: float = 60) -> None:
    """Return once the server at `url` is generating a request (fail after `timeout_s`)."""
    await asyncio.to_thread(
        wait_for, lambda: server_metric(url, "vllm:num_requests_running", api_key) >= 1, timeout_s,
        f"a request running on {url}", 0.02,
    )  # fmt: skip


# A user's project: their reward and tool modules, data and config in one folder. The modules take the
# names grpoflow's own folders have (tasks, storage, examples, flows): installed as `grpoflow.*` alone,
# grpoflow leaves those names to the user.
USER_TASK = """
import json as _json  # the standard library's, not a user file named json.py


def exact(prompts, completions, answer, **_):
    return [1.0 if c.strip() == str(_json.loads(_json.dumps(a))) else 0.0 for c, a in zip(completions, answer)]
"""

USER_TOOLS = '''
import json as _json


def lookup(key: str) -> str:
    """Look a key up.

    Args:
        key: the key
    """
    return _json.dumps({"key": key})
'''

USER_CONFIG = """
data:
  path: data.jsonl
rewards:
  - {name: exact, fn: "tasks:exact"}
  - {name: exact_in_a_process, fn: "examples.scoring:exact", executor: process}
tools:
  tools: ["storage:lookup"]
"""


def user_project(tmp_path: Path) -> tuple[Path, Path]:
    """The project folder and an empty folder to run from. The project's `tasks.py`, `storage/` and
    `examples/` hold its reward and tool; its `flows.py` and `json.py` would end the process if anything
    imported them in place of grpoflow's or the standard library's."""
    proj = tmp_path / "proj"
    proj.mkdir()
    (proj / "tasks.py").write_text(USER_TASK)
    (proj / "storage").mkdir()
    (proj / "storage" / "__init__.py").write_text(USER_TOOLS)
    (proj / "examples").mkdir()
    (proj / "examples" / "__init__.py").write_text("")
    (proj / "examples" / "scoring.py").write_text(USER_TASK)
    (proj / "data.jsonl").write_text('{"prompt": "1+1?", "answer": 2}\n{"prompt": "2+2?", "answer": 4}\n')
    (proj / "cfg.yaml").write_text(USER_CONFIG)
    for name in ("json", "flows"):
        (proj / f"{name}.py").write_text(f"raise SystemExit('a user file shadowed {name}')\n")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    return proj, elsewhere


def rich_group(gid: str = "train-00000003", n: int = 2) -> RolloutGroup:
    comps = []
    for i in range(n):
        comps.append(
            RolloutCompletion(
                sample_index=i,
                completion=f"<tool_call>x</tool_call> héllo {i}",
                completion_ids=[5, 6, 7, i],
                completion_mask=[1, 1, 0, 1],
                logprobs=[-0.5, -1.25, 0.0, -2.0],
                messages=[TaggedMessage("assistant", "call", True), TaggedMessage("tool", "42", False)],
                turns=[TurnRecord(10, 2, 0.25, "stop"), TurnRecord(13, 1, 0.5, "length")],
                tool_calls=[
                    ToolCallRecord(0, "calc", '{"e": "6*7"}', "42", False, None, 0.01),
                    ToolCallRecord(1, "calc", "{bad", "Error: x", True, "malformed", 0.0),
                ],
                truncated=i == 1,
                truncation_reason="max_tokens" if i == 1 else None,
                finish_reason="length" if i == 1 else "stop",
                policy_version=3,
                policy_version_end=4,
                gen_seconds=0.75,
                reward=None if i == 1 else 1.5,
                reward_valid=i == 0,
                invalid_reason="acc: failed: boom" if i == 1 else None,
                reward_cells=[
                    RewardCell(
                        "acc",
                        1.5 if i == 0 else None,
                        "valid" if i == 0 else "failed",
                        "" if i == 0 else "boom",
                        1.0,
                        0.125,
                    )
                ],
                advantage=0.5 if i == 0 else 0.0,
                trained=i == 0,
                drop_reason=None if i == 0 else "reward invalid",
            )
        )
    return RolloutGroup(gid, 3, "<prompt>", [1, 2, 3], comps, split="train", policy_version=3)


def train_samples() -> list:
    """Three learner samples: one prompt with two completions, the first rewarded and the second
    punished (a tool token masked in the first), and a second prompt's completion at advantage 0.5."""
    from grpoflow.tasks.learner.learner_api import TrainSample  # torch: imported by the tests that train

    return [
        TrainSample([5, 6, 7, 70, 71, 72], 3, [1, 0, 1], [-5.5, 0.0, -5.5], 1.0),
        TrainSample([5, 6, 7, 80, 81], 3, [1, 1], [-5.5, -5.5], -1.0),
        TrainSample([9, 9, 90, 91, 92, 93], 2, [1, 1, 1, 1], [-5.5] * 4, 0.5),
    ]


# Where make_learner's learners run unless a test names a device: `pytest --learner-device cuda` (the
# GPU machine's run, benchmarks/gpu_learner.py) runs the learner's tests on the GPU (tests/conftest.py).
LEARNER_DEVICE = "cpu"


def make_learner(model_dir, *, total_steps: int, seed: int = 0, tokenizer_path=None, skip_zero_advantage=True,
                 adapter_path=None, dtype: str = "float32", **fields) -> Learner:  # fmt: skip
    """A Learner whose config sections take the LearnerConfig / AlgorithmConfig fields among `fields`
    (off-policy correction off unless given: these samples' behaviour logprobs are made up), on
    LEARNER_DEVICE unless `device` is among them, computing in `dtype` (float32: the tests' exact
    comparisons hold on a GPU too; the precision recipe's tests ask for bfloat16)."""
    from grpoflow.tasks.config.algorithm import AlgorithmConfig  # torch: for the tests that train
    from grpoflow.tasks.config.learner import LearnerConfig
    from grpoflow.tasks.config.model import ModelConfig
    from grpoflow.tasks.learner.learn import Learner
    from grpoflow.tasks.learner.learner_api import LearnerRun

    fields.setdefault("device", LEARNER_DEVICE)

    algorithm = {"correction": "none"} | {
        k: fields.pop(k) for k in set(fields) & set(AlgorithmConfig.model_fields)
    }
    run = LearnerRun(total_steps, seed, tokenizer_path=tokenizer_path, adapter_path=adapter_path)
    return Learner(model_dir, LearnerConfig(**fields), AlgorithmConfig(**algorithm), run,
                   model=ModelConfig(dtype=dtype), skip_zero_advantage=skip_zero_advantage)  # fmt: skip


def save_reward_model(
    out: Path, tokenizer, *, arch: str = "llama", max_position_embeddings: int = 512, seed: int = 0
) -> Path:
    """A random tiny Llama- (or GPT-2-) ForSequenceClassification, one label and no pad id, + `tokenizer`.

    Llama's RoPE is relative, so left padding scores the same as right padding there; GPT-2's absolute
    positions are what catch a wrong padding side.
    """
    import torch
    from transformers import (
        GPT2Config,
        GPT2ForSequenceClassification,
        LlamaConfig,
        LlamaForSequenceClassification,
    )

    # one label, and no pad/bos/eos ids of its own: the tokenizer's
    common = dict(
        vocab_size=len(tokenizer), num_labels=1, pad_token_id=None, bos_token_id=None, eos_token_id=None
    )
    if arch == "gpt2":
        kind = GPT2ForSequenceClassification
        config = GPT2Config(n_embd=32, n_layer=2, n_head=2, n_positions=max_position_embeddings, **common)
    else:
        kind = LlamaForSequenceClassification
        config = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                             num_key_value_heads=2, head_dim=16, max_position_embeddings=max_position_embeddings,
                             **common)  # fmt: skip
    torch.manual_seed(seed)
    kind(config).save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def by_hand(path: Path, texts: list[str]) -> list[float]:
    """Each text alone, unpadded, through a freshly loaded model: logits[0, 0]."""
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForSequenceClassification.from_pretrained(path, dtype=torch.float32).eval()
    out = []
    with torch.inference_mode():
        for text in texts:
            ids = tokenizer(text, return_tensors="pt", add_special_tokens=False)
            out.append(float(model(**ids).logits[0, 0]))
    return out


def assistant_text(tok, ids: list[int]) -> str:
    """A single-turn completion's assistant message as generation records it (and `completions:
    messages` hands it to rewards): the tokens as the model wrote them, special ones kept, less a final EOS."""
    text = tok.decode(ids, skip_special_tokens=False)
    return text.removesuffix(tok.eos_token) if tok.eos_token else text


def toolbox(*fns, timeout_s: float = 10.0):
    """A ToolBox of plain functions, each under its own name."""
    from grpoflow.tasks.rollouts.tools import ToolBox

    return ToolBox({f.__name__: f for f in fns}, timeout_s)


def save_smollm2_tokenizer(out_dir: str | Path) -> Path:
    """SmolLM2-135M-Instruct's own tokenizer and chat template, from the GGUF, as a tokenizer dir
    (seconds, no weights): what tests of templates and tool-call formats load."""
    from grpoflow.tasks.models import save_gguf_tokenizer, smollm2_gguf_path

    out = Path(out_dir)
    return out if (out / "tokenizer_config.json").is_file() else save_gguf_tokenizer(smollm2_gguf_path(), out)


def server_imports() -> dict[str, set[str]]:
    """{module file of grpoflow.server: every module it imports, anywhere in it (absolute names; a
    function's imports too, as the worker extension imports torch and vllm inside its functions)}."""
    import ast

    out: dict[str, set[str]] = {}
    for path in sorted((REPO / "server").glob("*.py")):
        names: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom):
                assert node.level == 0, f"{path.name}: a relative import"  # the scan reads absolute names
                names.add(node.module)
        out[path.name] = names
    return out

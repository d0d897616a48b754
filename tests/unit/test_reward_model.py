"""Reward models by path: scoring matches the model run by hand, loads once, and the torch-free check."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from grpoflow.tasks.rewards import reward_model as rm
from grpoflow.tasks.rewards.reward_model import RewardModelError, check_reward_model, reward_model
from grpoflow.tasks.tiny_model import build_tiny_model, build_tokenizer
from tests.support import by_hand, save_reward_model

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]
SMOLLM = REPO / "models" / "smollm2-135m"


PROMPTS = [
    "What is 2+2?",
    "Hi",
    "A much longer prompt about the weather in spring,",
    "x",
    "Q: 7*6",
    "",
    "Say",
]
COMPLETIONS = [" 4", " there, how are you doing today?", " sunny.", "yz", " = 42 of course", "empty", " no"]


@pytest.mark.parametrize(
    "arch,pad",
    [("llama", "pad_token"), ("llama", "eos_as_pad"), ("gpt2", "pad_token"), ("gpt2", "eos_as_pad")],
)
def test_plain_scores_match_unpadded_model(tmp_path, arch, pad):
    tokenizer = build_tokenizer()
    if pad == "eos_as_pad":
        tokenizer.pad_token = None  # score() must fall back to the eos token
    path = save_reward_model(tmp_path / "rm", tokenizer, arch=arch)
    got = reward_model(path, device="cpu").score(PROMPTS, COMPLETIONS, batch_size=3)
    texts = [p + c for p, c in zip(PROMPTS, COMPLETIONS, strict=True)]
    assert len({len(t) for t in texts}) > 1 and len(got) == 7
    want = by_hand(path, texts)
    assert got == pytest.approx(want, abs=1e-5)
    assert len(set(round(v, 6) for v in got)) == 7  # not a constant head


def test_truncates_to_max_position_embeddings(tmp_path):
    path = save_reward_model(tmp_path / "rm", build_tokenizer(), max_position_embeddings=16)
    long = "abcdefghijklmnopqrstuvwxyz" * 2
    got = reward_model(path, device="cpu").score([long, "ab"], ["!", "c"], batch_size=2)
    assert got == pytest.approx(by_hand(path, [long[:16], "abc"]), abs=1e-5)


def test_conversational_uses_the_reward_tokenizers_chat_template(tmp_path):
    if not (SMOLLM / "tokenizer.json").is_file():
        pytest.skip(f"{SMOLLM} is absent: build it with `make models/smollm2-135m`")
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(SMOLLM)
    path = save_reward_model(tmp_path / "rm", tokenizer)
    prompts = [
        [{"role": "user", "content": "What is 2+2?"}],
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}],
        [{"role": "user", "content": "Hello"}],
    ]
    answers = ["4", "Blue, or perhaps a deep shade of green.", "Hi!"]
    model = reward_model(path, device="cpu")
    got = model.score(prompts, answers, batch_size=2)
    texts = [
        tokenizer.apply_chat_template(p + [{"role": "assistant", "content": a}], tokenize=False)
        for p, a in zip(prompts, answers, strict=True)
    ]
    assert all(t.startswith("<|im_start|>") and a in t for t, a in zip(texts, answers, strict=True))
    assert got == pytest.approx(by_hand(path, texts), abs=1e-5)
    as_messages = [[{"role": "assistant", "content": a}] for a in answers]
    assert model.score(prompts, as_messages, batch_size=2) == pytest.approx(got, abs=1e-6)


# Gemma's turn format (its instruction-tuned models'), BOS first: what a Gemma 3 reward model renders with.
GEMMA_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<start_of_turn>"
    "{{ 'model' if m['role'] == 'assistant' else m['role'] }}\n{{ m['content'] }}<end_of_turn>\n{% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)


def save_gemma3_reward_model(out: Path, tokenizer_dir: Path) -> Path:
    """A random tiny Gemma 3 sequence classifier (one label; a sliding-window layer beside a full one,
    two query heads on one KV head) with Gemma's real tokenizer and `GEMMA_TEMPLATE`. Weights drawn wide
    (0.3), as `build_tiny_gemma3` does, so that its scores differ from text to text."""
    import torch
    from transformers import AutoTokenizer, Gemma3TextConfig, Gemma3TextForSequenceClassification

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    tokenizer.chat_template = GEMMA_TEMPLATE
    config = Gemma3TextConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128,
                              num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=64,
                              sliding_window=4, layer_types=["sliding_attention", "full_attention"],
                              max_position_embeddings=512, initializer_range=0.3, num_labels=1,
                              pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
                              eos_token_id=tokenizer.eos_token_id)  # fmt: skip
    torch.manual_seed(0)
    Gemma3TextForSequenceClassification(config).save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def test_a_gemma3_reward_model_scores_plain_and_conversational_text(tmp_path, gemma3_tokenizer_dir):
    """The second model family as a reward model: Gemma 3's 262k-token tokenizer (pad id 0, BOS 2) and
    its sequence-classification head score each text as the model run by hand on it does."""
    import math

    path = save_gemma3_reward_model(tmp_path / "rm", gemma3_tokenizer_dir)
    model = reward_model(path, device="cpu")
    assert type(model.model).__name__ == "Gemma3TextForSequenceClassification"
    got = model.score(PROMPTS, COMPLETIONS, batch_size=3)  # padded, right, with Gemma's pad id
    prompts = [[{"role": "user", "content": "What is 2+2?"}], [{"role": "user", "content": "Name a colour."}],
               [{"role": "user", "content": "Hello"}]]  # fmt: skip
    answers = ["4", "Blue, or perhaps a deep shade of green.", "Hi!"]
    chat = model.score(prompts, answers, batch_size=2)  # through the reward tokenizer's (Gemma's) template
    assert len(got) == len(COMPLETIONS) and len(chat) == len(answers)
    assert all(isinstance(v, float) and math.isfinite(v) for v in got + chat)
    assert len(set(round(v, 6) for v in got)) == len(got)  # not a constant head

    # Plain text is scored as it is, without the special tokens the tokenizer adds (its BOS), as TRL does;
    # a conversation as its template renders it, with the template's BOS, once.
    plain = [p + c for p, c in zip(PROMPTS, COMPLETIONS, strict=True)]
    texts = [f"<bos><start_of_turn>user\n{p[0]['content']}<end_of_turn>\n<start_of_turn>model\n{a}<end_of_turn>\n"
             for p, a in zip(prompts, answers, strict=True)]  # fmt: skip
    assert all(model.tokenizer(t, add_special_tokens=False).input_ids.count(2) == 1 for t in texts)
    assert got + chat == pytest.approx(by_hand(path, plain + texts), abs=1e-5)  # one load of the model


class _CountingLock:
    """A lock that counts the threads that came to take it."""

    def __init__(self) -> None:
        self._lock, self._cv, self.callers = threading.Lock(), threading.Condition(), 0

    def __enter__(self) -> _CountingLock:
        with self._cv:
            self.callers += 1
            self._cv.notify_all()
        self._lock.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self._lock.release()

    def wait_for_callers(self, n: int, timeout_s: float) -> bool:
        with self._cv:
            return self._cv.wait_for(lambda: self.callers >= n, timeout_s)


def test_loaded_once_per_path_and_device_even_from_threads(tmp_path, monkeypatch):
    from transformers import AutoModelForSequenceClassification

    path = save_reward_model(tmp_path / "rm", build_tokenizer())
    loads, waited = [], []
    original = AutoModelForSequenceClassification.from_pretrained
    # The race made certain, not likely: the load goes on only once all four threads are at the key's
    # lock (the one loading holds it), so three of them ask while the model is being loaded.
    gate = _CountingLock()
    monkeypatch.setitem(rm._key_locks, (str(path.resolve()), "cpu"), gate)

    def counting(*args, **kwargs):
        loads.append(args[0])
        waited.append(gate.wait_for_callers(4, timeout_s=30))  # 30 s: a thread that never comes fails
        return original(*args, **kwargs)

    monkeypatch.setattr(AutoModelForSequenceClassification, "from_pretrained", counting)
    results, barrier = [], threading.Barrier(4)

    def load():
        barrier.wait()
        results.append(reward_model(str(path), "cpu"))

    threads = [threading.Thread(target=load) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(loads) == 1 and len(results) == 4 and all(r is results[0] for r in results)
    assert waited == [True]
    assert reward_model(path / ".." / "rm", "cpu") is results[0]
    assert len(loads) == 1
    assert reward_model(path, "auto").device in ("cpu", "cuda")


def test_score_from_several_threads(tmp_path):
    model = reward_model(save_reward_model(tmp_path / "rm", build_tokenizer()), "cpu")
    want = model.score(PROMPTS, COMPLETIONS, batch_size=3)
    results = [None] * 4

    def run(i):
        results[i] = model.score(PROMPTS, COMPLETIONS, batch_size=3)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(r == pytest.approx(want, abs=1e-6) for r in results)


def test_check_reward_model(tmp_path):
    good = save_reward_model(tmp_path / "rm", build_tokenizer())
    check_reward_model(good)
    check_reward_model(str(good))

    causal = build_tiny_model(tmp_path / "causal")
    with pytest.raises(RewardModelError, match="LlamaForCausalLM") as e:
        check_reward_model(causal)
    assert "\n" not in str(e.value) and "sequence-classification" in str(e.value)

    with pytest.raises(RewardModelError, match="does not exist"):
        check_reward_model(tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(RewardModelError, match="no config.json"):
        check_reward_model(tmp_path / "empty")

    no_tok = tmp_path / "no_tok"
    no_tok.mkdir()
    (no_tok / "config.json").write_text((good / "config.json").read_text())
    with pytest.raises(RewardModelError, match="no tokenizer files"):
        check_reward_model(no_tok)
    with pytest.raises(RewardModelError, match="no tokenizer files"):
        reward_model(no_tok, "cpu")


def test_check_reward_model_does_not_import_torch(tmp_path):
    good = save_reward_model(tmp_path / "rm", build_tokenizer())
    code = (
        "import json, sys; from grpoflow.tasks.rewards.reward_model import check_reward_model as c; "
        "c(sys.argv[1]); print(json.dumps(sorted(m for m in ('torch', 'transformers') if m in sys.modules)))"
    )
    out = subprocess.run([sys.executable, "-c", code, str(good)], cwd=REPO, capture_output=True, text=True,
                         timeout=120)  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    assert json.loads(out.stdout) == []  # checked without importing torch or transformers


@pytest.fixture(autouse=True)
def _fresh_cache():
    rm._cache.clear()
    rm._key_locks.clear()
    yield
    rm._cache.clear()
    rm._key_locks.clear()


def test_worker_allow_lists_bound_a_reward_model_path(tmp_path, monkeypatch):
    from grpoflow.flows.config import ConfigError, load_config
    from grpoflow.flows.training.preflight import confine

    inside = tmp_path / "inside"
    inside.mkdir()
    monkeypatch.setenv("GRPOFLOW_ALLOWED_ROOTS", str(inside))
    root = f"storage.root={inside / 'store'}"
    confine(load_config(None, [root, f"rewards=[{{name: rm, model: '{inside / 'rm'}'}}]"]))
    with pytest.raises(ConfigError, match=r"^rewards\[0\]\.model: .* is outside GRPOFLOW_ALLOWED_ROOTS"):
        confine(load_config(None, [root, f"rewards=[{{name: rm, model: '{tmp_path / 'rm'}'}}]"]))

"""LoRA lineages on one live server (the `lora_server`): lineage B promoted and served under its name
while lineage A is retrained, gated on the same server (candidate and incumbent side by side),
promoted, promoted again and rolled back, down to its base. B's name answers its own greedy tokens at
every point, A's name the new adapter's right after each swap, and neither name ever answers an error
while A's adapter is swapped (its name is an alias re-pointed between adapters loaded under internal
names, tasks/push/lora_serve.py)."""

from __future__ import annotations

import asyncio
import re
import threading

import pytest

from grpoflow.storage.sql import query
from tests.support import tiny_cfg

pytestmark = pytest.mark.integration
PROMPTS = ["Write a word like cat with many letters a.", "Write a word like banana with many letters a."]


def greedy(url: str, tok, model: str) -> list[list[int]]:
    from grpoflow.tasks.rollouts.inference import VLLMClient

    async def go():
        async with VLLMClient(url, retries=0) as c:
            ids = [tok.encode(p, add_special_tokens=False) for p in PROMPTS]
            return [
                (await c.complete(i, max_tokens=8, temperature=0.0, model=model))[0].token_ids for i in ids
            ]

    return asyncio.run(go())


def served(url: str) -> dict[str, str]:
    from grpoflow.tasks.rollouts.inference import VLLMClient

    async def go():
        async with VLLMClient(url) as c:
            return {m["id"]: m.get("root") for m in await c.models()}

    return asyncio.run(go())


def load_as(url: str, name: str, path: str) -> None:
    """The same adapter under a name of the test's own: its greedy tokens are the reference."""
    from grpoflow.tasks.rollouts.inference import VLLMClient

    async def go():
        async with VLLMClient(url) as c:
            await c.load_lora_adapter(name, path)

    asyncio.run(go())


def adapters_of(url: str, lineage: str) -> list[str]:
    """The internal names the server holds for `lineage`'s adapters (the alias's target, and no other
    once a swap is over); the lineage's training runs' own versions (`<run>@v<N>`, pushed to this same
    server here) are not among them."""
    return sorted(k for k in served(url) if k.startswith(f"{lineage}@") and not re.fullmatch(r".*@v\d+", k))


class Hammer:
    """Asks the given names for completions without pause until stopped; every error is kept, and
    every answer that differs from the name's `expected` tokens (when given)."""

    def __init__(self, url: str, tok, names: list[str], expected: dict[str, list[list[int]]] | None = None):
        self.url, self.tok, self.names, self.errors = url, tok, names, []
        self.expected, self.answers, self.rounds = expected or {}, dict.fromkeys(names, 0), 0
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)

    def run(self) -> None:
        while not self.stop.is_set():
            for name in self.names:
                try:
                    out = greedy(self.url, self.tok, name)
                    self.answers[name] += 1
                except Exception as e:  # any failure is the finding
                    self.errors.append(f"{name}: {e}")
                    continue
                if name in self.expected and out != self.expected[name]:
                    self.errors.append(f"{name}: answered {out}, not its adapter's {self.expected[name]}")
            self.rounds += 1

    def one_more_round(self) -> None:
        """Wait for a whole round of requests sent after this call (each name asked again)."""
        from tests.support import wait_for

        start = self.rounds
        wait_for(lambda: self.rounds >= start + 2 or not self.thread.is_alive(), 120, "a round of requests")

    def __enter__(self) -> Hammer:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join(timeout=60)


def test_a_lora_retrain_is_promoted_and_rolled_back_beside_another_lineage(
    tmp_path, lora_server, tiny_model_dir, prefect_api
):
    from transformers import AutoTokenizer

    from grpoflow.flows.lineage.promote import checkpoint_version, rollback
    from grpoflow.flows.lineage.retrain import grpo_retrain
    from grpoflow.tasks.push.lora_serve import internal_name

    url, tok = lora_server.url, AutoTokenizer.from_pretrained(tiny_model_dir)
    cfg = tiny_cfg(tmp_path, tiny_model_dir, url, **{
        "learner.lora": "{rank: 8, alpha: 16}", "data.eval_fraction": 0.25, "run.checkpoint_every": 100,
        "algorithm.max_staleness": 0, "learner.lr": 0.02,
    })  # fmt: skip
    # margin -inf: every candidate is promoted (the gate's scores are recorded, not relied on)
    gated = {"config": cfg, "server_url": url, "eval_server_url": url, "eval_prompts": 4,
             "eval_greedy": True, "gate_margin": -1e9}  # fmt: skip
    base_out = greedy(url, tok, "policy")

    b = grpo_retrain(lineage="lin-b", extra_steps=2, **gated)["decision"]
    assert b["decision"] == "promoted" and b["candidate_path"].endswith("/adapter")
    load_as(url, "ref-b", b["candidate_path"])
    b_out = greedy(url, tok, "ref-b")
    assert served(url)["lin-b"] == b["candidate_path"] and greedy(url, tok, "lin-b") == b_out

    a1 = grpo_retrain(lineage="lin-a", extra_steps=2, **gated)["decision"]
    assert a1["decision"] == "promoted" and a1["incumbent_run"] is None  # gated against the base
    load_as(url, "ref-a1", a1["candidate_path"])
    a1_out = greedy(url, tok, "ref-a1")
    assert served(url)["lin-a"] == a1["candidate_path"] and greedy(url, tok, "lin-a") == a1_out
    assert greedy(url, tok, "lin-b") == b_out

    assert adapters_of(url, "lin-a") == [internal_name("lin-a", a1["candidate_path"])]

    with Hammer(url, tok, ["lin-b", "lin-a"], {"lin-b": b_out}) as hammer:  # A swapped under live clients
        a2 = grpo_retrain(lineage="lin-a", extra_steps=1, **gated)["decision"]
        assert a2["decision"] == "promoted" and a2["incumbent_step"] == a1["candidate_step"]
        load_as(url, "ref-a2", a2["candidate_path"])
        a2_out = greedy(url, tok, "ref-a2")
        assert served(url)["lin-a"] == a2["candidate_path"] and greedy(url, tok, "lin-a") == a2_out
        assert adapters_of(url, "lin-a") == [internal_name("lin-a", a2["candidate_path"])]
        back = rollback(tmp_path, "lin-a", server_url=url)
        assert back["serving_path"] == a1["candidate_path"] == served(url)["lin-a"]
        assert greedy(url, tok, "lin-a") == a1_out
        assert adapters_of(url, "lin-a") == [internal_name("lin-a", a1["candidate_path"])]
        hammer.one_more_round()
    assert hammer.errors == [] and min(hammer.answers.values()) > 0, (hammer.errors[:5], hammer.answers)
    assert greedy(url, tok, "lin-b") == b_out
    assert a2["candidate_path"] == checkpoint_version(tmp_path, "lin-a")["path"]

    with Hammer(url, tok, ["lin-b", "lin-a"], {"lin-b": b_out}) as hammer:
        rollback(tmp_path, "lin-a", server_url=url)  # below the first promotion: the base, by name
        assert greedy(url, tok, "lin-a") == base_out
        hammer.one_more_round()
    assert hammer.errors == [] and min(hammer.answers.values()) > 0, (hammer.errors[:5], hammer.answers)
    assert served(url)["lin-a"].endswith("run_id=lin-a/base-adapter")
    assert adapters_of(url, "lin-a") == [internal_name("lin-a", served(url)["lin-a"])]
    assert greedy(url, tok, "lin-a") == base_out and greedy(url, tok, "lin-b") == b_out
    assert served(url)["lin-b"] == b["candidate_path"]

    _, rows = query(tmp_path, "SELECT lineage, decision, candidate_step, serving_path, server FROM promotions "
                              "ORDER BY lineage, decision_id")  # fmt: skip
    a_steps = [a1["candidate_step"], a2["candidate_step"]]
    assert [r[:3] for r in rows] == [
        ("lin-a", "promoted", a_steps[0]), ("lin-a", "promoted", a_steps[1]),
        ("lin-a", "rolled_back", a_steps[1]), ("lin-a", "rolled_back", a_steps[0]),
        ("lin-b", "promoted", b["candidate_step"]),
    ]  # fmt: skip
    assert rows[2][3] == a1["candidate_path"] and rows[3][3] == str(tiny_model_dir.resolve())
    assert all(r[4] == url for r in rows)

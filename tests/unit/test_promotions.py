"""The promotion log: decisions, the served stack, pins that retention respects, the SQL view, the gate.

Recording only: nothing here loads weights into a server (no `server_url`); the integration test
tests/integration/test_promotion.py does, on real vLLM servers."""

from __future__ import annotations

import asyncio
import json
import time

import pytest

from grpoflow.flows.lineage.promote import (
    base_version,
    checkpoint_version,
    promote,
    reject,
    rollback,
    serving_version,
)
from grpoflow.flows.lineage.retrain import gate
from grpoflow.storage.checkpoints import CheckpointStore
from grpoflow.storage.promotions import PromotionError, PromotionLog
from grpoflow.storage.rollouts import RolloutStore
from grpoflow.storage.sql import query, run_canned

pytestmark = pytest.mark.unit


@pytest.fixture
def root(tmp_path, monkeypatch):
    # Prefect events and artifacts outside a flow run: no API is needed (they are dropped).
    monkeypatch.setattr("grpoflow.flows.lineage.promote._announce", lambda row: None)
    store = CheckpointStore(tmp_path)
    for step in range(4):

        def write(d):
            (d / "model").mkdir()
            (d / "model" / "config.json").write_text("{}")

        store.save("lin", step, write, {"step": step})
    (tmp_path / "base").mkdir()
    RolloutStore(tmp_path).write_run_meta("lin", {"run_id": "lin", "base_model": str(tmp_path / "base")})
    return tmp_path


def test_promote_reject_rollback_keep_the_served_version_and_history(root):
    base = base_version(root, "lin")
    v1, v3 = checkpoint_version(root, "lin", 1), checkpoint_version(root, "lin")
    assert v3["step"] == 3 and v3["path"].endswith("step-000003/model") and base["run"] is None
    assert serving_version(root, "lin") is None
    promote(root, "lin", v1, incumbent=base, server_url=None, reason="first")
    reject(root, "lin", v3, incumbent=v1, server_url=None, reason="worse",
           scores={"metric": "reward_mean", "margin": 0.0, "candidate_score": 0.1, "incumbent_score": 0.2})  # fmt: skip
    assert serving_version(root, "lin") == v1
    promote(root, "lin", v3, incumbent=v1, server_url=None, reason="better")
    assert serving_version(root, "lin") == v3
    assert rollback(root, "lin", server_url=None)["reason"] == "rolled back to lin step 1"
    assert serving_version(root, "lin") == v1
    assert rollback(root, "lin", server_url=None)["reason"] == "rolled back to the base model"
    assert serving_version(root, "lin") == base
    with pytest.raises(PromotionError, match="no promoted version to roll back from"):
        rollback(root, "lin", server_url=None)
    history = PromotionLog(root).history("lin")
    assert [r["decision"] for r in history] == [
        "promoted",
        "rejected",
        "promoted",
        "rolled_back",
        "rolled_back",
    ]
    assert [r["decision_id"] for r in history] == [0, 1, 2, 3, 4]
    assert history[1]["candidate_score"] == 0.1 and history[1]["serving_step"] == 1


def test_retention_never_prunes_a_served_version_or_its_rollback_target(root):
    store = CheckpointStore(root)
    v0, v1 = checkpoint_version(root, "lin", 0), checkpoint_version(root, "lin", 1)
    promote(root, "lin", v0, incumbent=base_version(root, "lin"), server_url=None, reason="a")
    promote(root, "lin", v1, incumbent=v0, server_url=None, reason="b")
    store.dirs.prune("lin", 1)
    assert store.list("lin") == [0, 1, 3]  # step 2 was neither served nor a rollback target
    rollback(root, "lin", server_url=None)  # v1 is off the stack: unpinned
    store.dirs.prune("lin", 1)
    assert store.list("lin") == [0, 3]


def test_a_failed_load_leaves_nothing_recorded_or_pinned(root, monkeypatch):
    def dead(*a, **k):
        raise ConnectionError("server down")

    monkeypatch.setattr("grpoflow.flows.lineage.promote.load_into_server", dead)
    v2 = checkpoint_version(root, "lin", 2)
    with pytest.raises(ConnectionError):
        promote(
            root, "lin", v2, incumbent=base_version(root, "lin"), server_url="http://127.0.0.1:9", reason="x"
        )
    assert PromotionLog(root).history("lin") == []
    assert not list((root / "checkpoints" / "lin" / "step-000002").glob("PINNED*"))


def test_bad_versions_are_named(root):
    with pytest.raises(PromotionError, match="no checkpoint at step 9"):
        checkpoint_version(root, "lin", 9)
    with pytest.raises(PromotionError, match="run 'other' has no checkpoint"):
        checkpoint_version(root, "other")


@pytest.fixture
def lora_root(root):
    """Two LoRA lineages ("ada", "bea"), three checkpoints each: `adapter/` + learner.json's base."""
    import torch
    from safetensors.torch import save_file

    store = CheckpointStore(root)
    for run in ("ada", "bea"):
        for step in range(3):

            def write(d, step=step):
                (d / "adapter").mkdir()
                (d / "adapter" / "adapter_config.json").write_text(json.dumps({"r": 8, "peft_type": "LORA"}))
                w = {"m.lora_A.weight": torch.ones(8, 4), "m.lora_B.weight": torch.full((4, 8), step + 1.0)}
                save_file(w, str(d / "adapter" / "adapter_model.safetensors"))
                (d / "learner.json").write_text(json.dumps({"base_model": str(root / "base")}))

            store.save(run, step, write, {"step": step})
        RolloutStore(root).write_run_meta(run, {"run_id": run, "base_model": str(root / "base")})
    return root


def _served(server) -> dict[str, str]:
    """{lineage: the adapter path its name serves} on the scripted server (through its alias)."""
    return {a: server.adapters[t] for a, t in server.aliases_.items()}


def test_lora_lineages_promote_and_roll_back_by_name_on_one_shared_server(lora_root, monkeypatch):
    from safetensors.torch import load_file

    from grpoflow.tasks.push.lora_serve import internal_name
    from tests.unit.scripted import ScriptedBackend

    root, server = lora_root, ScriptedBackend(None, None)
    monkeypatch.setattr("grpoflow.tasks.rollouts.inference.client_for", lambda url, inference, **k: server)
    url = "http://scripted.invalid"
    b1 = checkpoint_version(root, "bea", 1)
    assert b1["path"].endswith("step-000001/adapter")
    promote(root, "bea", b1, incumbent=base_version(root, "bea"), server_url=url, reason="b")
    a1, a2 = checkpoint_version(root, "ada", 1), checkpoint_version(root, "ada", 2)
    promote(root, "ada", a1, incumbent=base_version(root, "ada"), server_url=url, reason="a1")
    promote(root, "ada", a2, incumbent=a1, server_url=url, reason="a2")
    assert _served(server) == {"bea": b1["path"], "ada": a2["path"]}
    rollback(root, "ada", server_url=url)
    assert _served(server) == {"bea": b1["path"], "ada": a1["path"]}
    rollback(root, "ada", server_url=url)  # below its first promotion: the base, as an identity adapter
    identity = _served(server)["ada"]
    assert identity.endswith("run_id=ada/base-adapter") and _served(server)["bea"] == b1["path"]
    assert load_file(f"{identity}/adapter_model.safetensors")["m.lora_B.weight"].abs().sum() == 0
    assert serving_version(root, "ada") == base_version(root, "ada")
    # Each adapter is loaded once under its own internal name (never in place: no per-step re-reads),
    # the alias re-pointed, and only then the one it pointed at unloaded (no 404 window); "bea" was
    # loaded once, never touched again; no server-wide prefix-cache reset.
    ia1, ia2, ib = (
        internal_name("ada", a1["path"]),
        internal_name("ada", a2["path"]),
        internal_name("bea", b1["path"]),
    )
    i0 = internal_name("ada", identity)
    assert server.calls == [
        ("load", ib), ("alias", f"bea->{ib}"),
        ("load", ia1), ("alias", f"ada->{ia1}"),
        ("load", ia2), ("alias", f"ada->{ia2}"), ("unload", ia1),
        ("load", ia1), ("alias", f"ada->{ia1}"), ("unload", ia2),
        ("load", i0), ("alias", f"ada->{i0}"), ("unload", ia1),
    ]  # fmt: skip
    assert set(server.adapters) == {ib, i0}
    promote(root, "ada", a2, incumbent=base_version(root, "ada"), server_url=url, reason="again")
    assert _served(server)["ada"] == a2["path"] and server.calls[-1] == ("unload", i0)
    assert [r["decision"] for r in PromotionLog(root).history("ada")] == [
        "promoted", "promoted", "rolled_back", "rolled_back", "promoted"
    ]  # fmt: skip


def test_a_lora_version_already_served_is_kept(lora_root, monkeypatch):
    from grpoflow.tasks.push.lora_serve import internal_name
    from tests.unit.scripted import ScriptedBackend

    server = ScriptedBackend(None, None)
    monkeypatch.setattr("grpoflow.tasks.rollouts.inference.client_for", lambda url, inference, **k: server)
    a1 = checkpoint_version(lora_root, "ada", 1)
    for reason in ("first", "again"):
        promote(lora_root, "ada", a1, incumbent=None, server_url="http://s.invalid", reason=reason)
    name = internal_name("ada", a1["path"])
    assert server.calls == [("load", name), ("alias", f"ada->{name}")]


def test_a_swap_unloads_the_replaced_adapter_only_once_requests_sent_to_it_have_left(lora_root, monkeypatch):
    """A request rewritten to the old adapter just before the swap resolves it by name a few awaits
    later: the unload waits for the middleware's in-flight count to drop (bounded by drain_s)."""
    from grpoflow.tasks.push.lora_serve import serve_adapter
    from tests.unit.scripted import ScriptedBackend

    server = ScriptedBackend(None, None)
    a1, a2 = (checkpoint_version(lora_root, "ada", s)["path"] for s in (1, 2))

    async def go():
        assert await serve_adapter(server, "ada", a1) == "loaded"
        old = server.aliases_["ada"]
        server.in_flight[old] = 1
        swap = asyncio.create_task(serve_adapter(server, "ada", a2))
        # the swap is draining once it has asked for the in-flight count twice (still 1 both times)
        deadline = time.monotonic() + 30
        while server.in_flight_polls < 2:
            assert time.monotonic() < deadline, "the swap never asked for the in-flight count"
            await asyncio.sleep(0.01)
        assert not swap.done() and old in server.adapters and server.aliases_["ada"] != old
        del server.in_flight[old]
        assert await swap == "replaced" and old not in server.adapters
        stuck = server.aliases_["ada"]
        server.in_flight[stuck] = 1  # a request that never leaves: bounded wait
        polls = server.in_flight_polls
        # drain_s bounds the wait: it returns (60 s fails the test), having waited (polled again and
        # again) and then unloaded the adapter whose request is still counted
        assert await asyncio.wait_for(serve_adapter(server, "ada", a1, drain_s=0.3), 60) == "replaced"
        assert server.in_flight_polls - polls >= 2 and stuck not in server.adapters

    asyncio.run(go())


def test_a_server_without_the_alias_middleware_is_refused_with_how_to_start_one(lora_root):
    from grpoflow.tasks.push.lora_serve import serve_adapter
    from grpoflow.tasks.push.push_api import WeightPushError
    from grpoflow.tasks.rollouts.inference_api import InferenceHTTPError
    from tests.unit.scripted import ScriptedBackend

    class OldServer(ScriptedBackend):
        async def aliases(self):
            raise InferenceHTTPError(404, '{"detail":"Not Found"}', "http://s/grpoflow/aliases")

    with pytest.raises(WeightPushError, match="no grpoflow alias middleware.*grpoflow serve --lora-rank"):
        asyncio.run(
            serve_adapter(OldServer(None, None), "ada", checkpoint_version(lora_root, "ada", 1)["path"])
        )


def test_promotions_view_and_canned_history(root):
    promote(root, "lin", checkpoint_version(root, "lin", 1), incumbent=base_version(root, "lin"),
            server_url=None, reason="first")  # fmt: skip
    cols, rows = run_canned(root, "promotions", "lin")
    assert rows[0][cols.index("decision")] == "promoted" and rows[0][cols.index("candidate_step")] == 1
    _, n = query(root, "SELECT count(*) FROM promotions WHERE lineage = 'other'")
    assert n == [(0,)]


def test_empty_store_has_an_empty_promotions_view(tmp_path):
    cols, rows = query(tmp_path, "SELECT * FROM promotions")
    assert rows == [] and "serving_path" in cols


@pytest.mark.parametrize(
    ("cand", "inc", "margin", "promoted"),
    [(0.5, 0.4, 0.0, True), (0.4, 0.4, 0.0, False), (0.45, 0.4, 0.1, False), (None, 0.1, 0.0, False),
     (0.1, None, 0.0, True)],
)  # fmt: skip
def test_the_gate(cand, inc, margin, promoted):
    ok, why = gate(cand, inc, "reward_mean", margin)
    assert ok is promoted and "reward_mean" in why


def test_a_lineages_server_starts_from_what_it_serves(root):
    from grpoflow.flows.processes.policy_server import served_model_dir

    assert served_model_dir(root, "lin", "base-dir") == "base-dir"  # nothing decided yet
    with pytest.raises(ValueError, match="lineage 'lin' has no promotion"):
        served_model_dir(root, "lin", None)
    v2 = checkpoint_version(root, "lin", 2)
    promote(root, "lin", v2, incumbent=base_version(root, "lin"), server_url=None, reason="x")
    assert served_model_dir(root, "lin", "base-dir") == v2["path"]
    rollback(root, "lin", server_url=None)
    assert served_model_dir(root, "lin", "base-dir") == str(root / "base")


def test_run_meta_without_a_base_model(tmp_path):
    RolloutStore(tmp_path).write_run_meta("x", {"run_id": "x"})
    assert base_version(tmp_path, "x") is None
    assert json.loads((tmp_path / "runs" / "x.json").read_text())["run_id"] == "x"


def test_the_gate_of_a_lora_lineage_evaluates_both_adapters_side_by_side(lora_root, monkeypatch):
    from contextlib import contextmanager

    import grpoflow.flows.lineage.retrain as retrain
    from grpoflow.flows.config import GRPOConfig

    started, evaluated = [], []

    @contextmanager
    def server(inference, model, root, name, lora=None, dtype=None):
        started.append((model, lora and lora.rank, dtype))
        yield type("S", (), {"url": "http://gate.invalid"})

    def evaluate(cfg, model, step, run, rows, url, *, load, tokenizer=None, what="the evaluation"):
        evaluated.append((model, run, load, tokenizer))
        return []

    monkeypatch.setattr(retrain, "inference_server", server)
    monkeypatch.setattr(retrain, "evaluate_model", evaluate)
    cfg, base = GRPOConfig(), str(lora_root / "base")
    a1, a2 = checkpoint_version(lora_root, "ada", 1), checkpoint_version(lora_root, "ada", 2)
    retrain._evaluate_both(cfg, "ada", a2, a1, [], None)
    from grpoflow.flows.processes.vllm_command import served_dtype

    assert started == [(base, 8, served_dtype(cfg))]  # one server, on the base, LoRA on, the run's dtype
    assert evaluated == [(a2["path"], "ada-eval", True, base), (a1["path"], "ada-eval-incumbent", True, base)]
    evaluated.clear()
    retrain._evaluate_both(cfg, "ada", a2, base_version(lora_root, "ada"), [], None)
    assert evaluated[1] == (
        str(lora_root / "base"),
        "ada-eval-incumbent",
        False,
        base,
    )  # the server's own model


def test_a_lora_server_serves_each_lineage_under_its_name_from_the_log(lora_root, monkeypatch, capsys):
    from grpoflow.flows.cli import main as cli
    from grpoflow.flows.processes.policy_server import lora_lineages

    root = lora_root
    assert cli.main(["serve", "--lineage", "ada", "--lineage", "bea", "--root", str(root)]) == 2
    assert "give --lora-rank R" in capsys.readouterr().err
    assert cli.main(["serve", "--lineage", "ada", "--lora-rank", "8", "--root", str(root)]) == 2
    assert "no LoRA promotion recorded" in capsys.readouterr().err
    a1, b2 = checkpoint_version(root, "ada", 1), checkpoint_version(root, "bea", 2)
    promote(root, "ada", a1, incumbent=base_version(root, "ada"), server_url=None, reason="a")
    promote(root, "bea", b2, incumbent=base_version(root, "bea"), server_url=None, reason="b")
    base, adapters = lora_lineages(root, ["ada", "bea", "new"], None)
    assert base == str(root / "base") and adapters == {"ada": a1["path"], "bea": b2["path"]}
    rollback(root, "ada", server_url=None)
    _, adapters = lora_lineages(root, ["ada"], "/m")
    assert adapters["ada"].endswith("run_id=ada/base-adapter")


def test_an_evaluation_a_required_reward_broke_on_is_refused():
    """Every cell of a required reward failed (a Ray cluster the evaluation never joined, a bug): an
    evaluation (grpo-evaluate's, the gate's) raises, naming the reward, rather than read "no valid
    reward" (the gate would reject every candidate). An optional reward broken, or one failing on some
    completions only, is data."""
    from grpoflow.flows.config import GRPOConfig
    from grpoflow.flows.lineage.evaluate import refuse_broken
    from grpoflow.storage.records import RewardCell, RolloutCompletion, RolloutGroup
    from grpoflow.tasks.rewards.broken_rewards import BrokenRewardError

    cfg = GRPOConfig.model_validate({"rewards": [{"name": "acc", "fn": "grpoflow.examples.rewards:letter_fraction"},
                                                 {"name": "style", "fn": "grpoflow.examples.rewards:letter_fraction",
                                                  "required": False}]})  # fmt: skip

    def groups(acc_failing: int) -> list[RolloutGroup]:
        comps = [RolloutCompletion(i, "a", [1], [1], [-1.0], reward_cells=[
            RewardCell("acc", None, "failed", "RuntimeError: no Ray") if i < acc_failing else RewardCell("acc", 1.0, "valid"),
            RewardCell("style", None, "failed", "KeyError: x")]) for i in range(4)]  # fmt: skip
        return [RolloutGroup("g", 0, "p", [1], comps)]

    with pytest.raises(
        BrokenRewardError, match=r"candidate is broken.*'acc' failed on 4/4 completions: RuntimeError: no Ray"
    ):
        refuse_broken(cfg, groups(4), "the gate's evaluation of the candidate")
    refuse_broken(cfg, groups(3), "the gate's evaluation of the candidate")  # one valid cell: data to mask

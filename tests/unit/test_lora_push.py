"""The `lora` weight push and the requests that name its adapters, against the SCRIPTED FAKE server
(tests/unit/scripted.py: vLLM 0.32's answers to adapter loads, unloads and unknown model names);
the client's HTTP calls against a FAKE aiohttp server. The real server: tests/integration."""

from __future__ import annotations

import asyncio
import json

import pytest
from aiohttp import web

import grpoflow.tasks.rollouts.generate as gen
from grpoflow.tasks.config.inference import InferenceConfig, SyncConfig
from grpoflow.tasks.config.rollouts import GenerationConfig, ToolsConfig
from grpoflow.tasks.push.push import (
    CheckpointPush,
    LoraPush,
    LoraUnsupportedError,
    MergedLoraPush,
    push_version,
    weight_push,
)  # fmt: skip
from grpoflow.tasks.rollouts.cache_salt import cache_salt_for
from grpoflow.tasks.rollouts.inference import VLLMClient
from grpoflow.tasks.rollouts.inference_api import InferenceHTTPError
from grpoflow.tasks.rollouts.replicas import Replica, ReplicaSet, Servers, VersionBox
from grpoflow.tasks.tiny_model import build_tokenizer
from tests.unit.scripted import ScriptedBackend

pytestmark = pytest.mark.unit
URL = "http://scripted.invalid"


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


async def says_done(text, k, seed):
    return "done"


def adapter(rank: int = 16):
    """What the learner's write_weights fills a version's dir with (a placeholder weights file)."""

    def write(directory):
        (directory / "adapter_config.json").write_text(json.dumps({"r": rank, "lora_alpha": 32}))
        (directory / "adapter_model.safetensors").write_text("x")

    return write


class FlipRecorder(VersionBox):
    """A server's version box noting, at each flip, which adapters the server held."""

    def __init__(self, backend: ScriptedBackend):
        super().__init__()
        self.backend, self.flips = backend, []

    def set(self, v: int) -> None:
        if v:  # not the ReplicaSet's start at version 0
            self.flips.append((v, sorted(self.backend.adapters)))
        super().set(v)


def lora_setup(tmp_path, tok, keep_last: int = 2, grace_s: float = 0.0, **backend):
    b = ScriptedBackend(tok, says_done, **backend)
    box = FlipRecorder(b)
    pusher = LoraPush(tmp_path, "run", SyncConfig(backend="lora", keep_last=keep_last), InferenceConfig(),
                      client=lambda url: b, unload_grace_s=grace_s)  # fmt: skip
    return b, box, pusher, ReplicaSet([Replica(0, URL, versions=box)])


def on_disk(tmp_path) -> list[str]:
    return sorted(p.name for p in (tmp_path / "weights" / "run").iterdir() if not p.name.startswith("."))


def test_each_version_is_loaded_under_its_own_name_and_flips_once_loaded(tmp_path, tok):
    b, box, pusher, servers = lora_setup(tmp_path, tok)
    for v in (1, 2, 3, 4):
        stats = push_version(pusher, adapter(), v, servers)
        assert stats.failed_servers == 0 and servers.version == v
        assert b.adapters[f"run@v{v}"] == str(tmp_path / "weights" / "run" / f"v{v:06d}")
    # Each flip happens once the server holds the version's adapter (and still the previous one).
    assert box.flips == [(1, ["run@v1"]), (2, ["run@v1", "run@v2"]), (3, ["run@v1", "run@v2", "run@v3"]),
                         (4, ["run@v2", "run@v3", "run@v4"])]  # fmt: skip
    # keep_last 2: the current and the previous version stay loaded, the older ones are unloaded.
    assert b.calls == [("load", "run@v1"), ("load", "run@v2"), ("load", "run@v3"), ("unload", "run@v1"),
                       ("load", "run@v4"), ("unload", "run@v2")]  # fmt: skip
    assert pusher.model_name(4) == "run@v4" and CheckpointPush(tmp_path, "run", SyncConfig(),
                                                               InferenceConfig()).model_name(4) is None  # fmt: skip


@pytest.mark.parametrize(
    "keep_last, loaded", [(1, ["run@v4", "run@v5"]), (3, ["run@v3", "run@v4", "run@v5"])]
)
def test_the_previous_version_is_never_unloaded(tmp_path, tok, keep_last, loaded):
    b, _, pusher, servers = lora_setup(tmp_path, tok, keep_last=keep_last)
    for v in (1, 2, 3, 4, 5):
        push_version(pusher, adapter(), v, servers)
    assert sorted(b.adapters) == loaded


def test_forget_never_deletes_the_files_of_a_version_a_server_may_still_read(tmp_path, tok):
    b, _, pusher, servers = lora_setup(tmp_path, tok, keep_last=1)
    push_version(pusher, adapter(), 1, servers)
    push_version(pusher, adapter(), 2, servers)
    # keep_last 1 on disk, but the server holds v1 (the previous version) too: its files stay.
    assert on_disk(tmp_path) == ["v000001", "v000002"]
    push_version(pusher, adapter(), 3, servers)
    assert on_disk(tmp_path) == ["v000002", "v000003"] and sorted(b.adapters) == ["run@v2", "run@v3"]

    # An unloaded version's files stay for the grace period (a request that named it may still run).
    b, _, pusher, servers = lora_setup(tmp_path / "grace", tok, keep_last=1, grace_s=3600)
    for v in (1, 2, 3, 4):
        push_version(pusher, adapter(), v, servers)
    assert sorted(b.adapters) == ["run@v3", "run@v4"] and len(on_disk(tmp_path / "grace")) == 4

    # An unload that fails leaves the version held: its files stay, and the next push tries again.
    b, _, pusher, servers = lora_setup(tmp_path / "stuck", tok, keep_last=1)
    unload = b.unload_lora_adapter

    async def refuses(name):
        raise InferenceHTTPError(500, "busy", URL)

    b.unload_lora_adapter = refuses
    for v in (1, 2, 3):
        push_version(pusher, adapter(), v, servers)
    assert sorted(b.adapters) == ["run@v1", "run@v2", "run@v3"]
    assert on_disk(tmp_path / "stuck") == ["v000001", "v000002", "v000003"]
    b.unload_lora_adapter = unload
    push_version(pusher, adapter(), 4, servers)
    assert sorted(b.adapters) == ["run@v3", "run@v4"]
    assert on_disk(tmp_path / "stuck") == ["v000003", "v000004"]


def test_a_name_the_server_holds_is_loaded_afresh_and_a_previous_process_adapters_are_unloaded(tmp_path, tok):
    b, box, pusher, servers = lora_setup(tmp_path, tok)
    # What a crashed process of the run left on an external server, and another run's adapter.
    b.adapters.update({"run@v2": "/old/v2", "run@v9": "/old/v9", "other@v1": "/other"})
    push_version(pusher, adapter(), 2, servers)
    # Not load_inplace (vLLM would re-read the files at every step): unloaded, then loaded again.
    assert b.calls == [("load", "run@v2"), ("unload", "run@v2"), ("load", "run@v2"), ("unload", "run@v9")]
    assert b.adapters == {"run@v2": str(tmp_path / "weights" / "run" / "v000002"), "other@v1": "/other"}
    assert box.get() == 2
    # Promotion's prefix-cache reset: only when a name is loaded again (a new name cannot hit old KV).
    promo = LoraPush(tmp_path, "run", SyncConfig(backend="lora"), InferenceConfig(), reset_prefix_cache=True,
                     client=lambda url: b)  # fmt: skip
    b.calls.clear()
    path = b.adapters["run@v2"]
    asyncio.run(promo.load(URL, path, 3))
    asyncio.run(promo.load(URL, path, 3))
    assert [c for c, _ in b.calls].count("reset_prefix_cache") == 1


@pytest.mark.parametrize(
    "server, why",
    [
        ({"route": False}, "it has no /v1/load_lora_adapter"),
        ({"max_lora_rank": None}, "LoRA is not enabled"),
        ({"max_lora_rank": 8}, "its --max-lora-rank is below the adapter's rank 16"),
    ],
    ids=["no-runtime-lora-route", "lora-not-enabled", "rank-too-small"],
)
def test_a_server_that_cannot_load_adapters_says_how_to_start_it(tmp_path, tok, server, why):
    _, box, pusher, servers = lora_setup(tmp_path, tok, **server)
    with pytest.raises(LoraUnsupportedError) as e:
        push_version(pusher, adapter(16), 1, servers)
    msg = str(e.value)
    assert URL in msg and why in msg and "learner.lora" in msg, msg
    assert "--enable-lora --max-lora-rank 16" in msg and "VLLM_ALLOW_RUNTIME_LORA_UPDATING=True" in msg, msg
    assert servers.version == 0 and box.flips == []


def test_a_failed_load_names_version_and_path_and_leaves_the_version(tmp_path, tok):
    b, _, pusher, servers = lora_setup(tmp_path, tok)
    push_version(pusher, adapter(), 1, servers)

    async def broken(name, path):
        raise InferenceHTTPError(500, '{"error": {"message": "bad adapter weights"}}', URL)

    b.load_lora_adapter = broken
    with pytest.raises(Exception) as e:
        push_version(pusher, adapter(), 2, servers)
    assert not isinstance(e.value, LoraUnsupportedError)
    msg = str(e.value)
    assert "v2" in msg and "v000002" in msg and "bad adapter weights" in msg, msg
    assert "serves what it served" in msg
    assert servers.version == 1 and b.adapters.keys() == {"run@v1"}
    # A dir that holds no adapter (a full model's) is refused before the server is asked.
    with pytest.raises(Exception, match="holds none"):
        asyncio.run(pusher.load(URL, str(tmp_path), 3))


def test_weight_push_picks_the_backend_and_none_is_checkpoint(tmp_path):
    inf = InferenceConfig()
    assert isinstance(weight_push(tmp_path, "r", SyncConfig(), inf), CheckpointPush)
    assert isinstance(weight_push(tmp_path, "r", SyncConfig(backend="lora"), inf), LoraPush)
    assert isinstance(weight_push(tmp_path, "r", SyncConfig(backend="lora_merged"), inf), MergedLoraPush)


def test_only_adapters_served_as_adapters_enable_lora_in_the_runs_servers():
    from grpoflow.flows.config import GRPOConfig
    from grpoflow.flows.training.train import served_lora

    lora = {"learner": {"lora": {"rank": 8}}}
    assert served_lora(GRPOConfig.model_validate(lora)).rank == 8  # backend None -> 'lora'
    merged = GRPOConfig.model_validate({**lora, "sync": {"backend": "lora_merged"}})
    assert merged.sync.backend == "lora_merged" and served_lora(merged) is None
    assert served_lora(GRPOConfig()) is None


# -- generation names the version's adapter --------------------------------------------------------------


def lora_servers(backend: ScriptedBackend, version: int) -> Servers:
    replicas = ReplicaSet([Replica(0, URL)], version=version)
    replicas.model_name = lambda v: f"run@v{v}"
    return Servers(replicas, [backend])


def test_requests_name_the_adapter_of_the_version_they_run_under(tok):
    async def script(text, k, seed):
        return "<tool_call>" + json.dumps({"name": "ping", "arguments": {}}) + "</tool_call>" if "pong" not in text else "done"  # fmt: skip

    backend = ScriptedBackend(tok, script)
    backend.adapters.update({"run@v3": "/a3", "run@v4": "/a4"})
    servers = lora_servers(backend, 3)

    def ping() -> str:
        """Ping."""
        servers.replicas.replicas[0].versions.set(4)  # a push lands while the rollout waits for its tool
        return "pong"

    asyncio.run(gen.generate_groups([{"prompt": "p"}], [0], servers=servers, tokenizer=tok, generation=GenerationConfig(group_size=1, max_tokens=64, max_turns=3), tools=ToolsConfig(tools=[ping])))  # fmt: skip
    # Each turn names the version it reads, with that version's salt.
    assert [(r["model"], r["cache_salt"]) for r in backend.requests] == [
        ("run@v3", cache_salt_for(3)), ("run@v4", cache_salt_for(4))]  # fmt: skip
    single = ScriptedBackend(tok, says_done)
    single.adapters["run@v4"] = "/a4"
    (g,) = asyncio.run(gen.generate_groups([{"prompt": "q"}], [1], servers=lora_servers(single, 4), tokenizer=tok, generation=GenerationConfig(group_size=2, max_tokens=4)))  # fmt: skip
    assert [r["model"] for r in single.requests] == ["run@v4"] and g.policy_version == 4
    # The checkpoint backend's servers: requests name no model (the client's own).
    plain = ScriptedBackend(tok, says_done)
    asyncio.run(gen.generate_groups([{"prompt": "q"}], [1], servers=Servers(ReplicaSet([Replica(0, URL)]), [plain]), tokenizer=tok, generation=GenerationConfig(group_size=2, max_tokens=4)))  # fmt: skip
    assert [r["model"] for r in plain.requests] == [None]


def test_a_request_whose_adapter_was_unloaded_on_its_way_is_asked_again_under_the_new_version(tok):
    backend = ScriptedBackend(tok, says_done)
    backend.adapters["run@v5"] = "/a5"  # v4 was unloaded before the request reached the server
    servers = lora_servers(backend, 4)
    complete = backend.complete

    async def push_lands_first(ids, **kw):
        if kw["model"] == "run@v4":
            servers.replicas.replicas[0].versions.set(5)
        return await complete(ids, **kw)

    backend.complete = push_lands_first
    (g,) = asyncio.run(gen.generate_groups([{"prompt": "q"}], [1], servers=servers, tokenizer=tok, generation=GenerationConfig(group_size=2, max_tokens=4)))  # fmt: skip
    assert [r["model"] for r in backend.requests] == ["run@v5"]
    assert all(c.policy_version == 5 for c in g.completions)
    # The version did not change: the 404 is an error, not a loop.
    stuck = ScriptedBackend(tok, says_done)
    with pytest.raises(InferenceHTTPError, match="does not exist"):
        asyncio.run(gen.generate_groups([{"prompt": "q"}], [1], servers=lora_servers(stuck, 4), tokenizer=tok, generation=GenerationConfig(group_size=2, max_tokens=4)))  # fmt: skip


# -- the client's calls ------------------------------------------------------------------------------------


@pytest.fixture
async def adapter_server():
    """FAKE vLLM answering adapter loads with `state["status"]` (200 by default); bodies recorded."""
    app, state = web.Application(), {"bodies": [], "status": 200}

    async def handler(request: web.Request) -> web.Response:
        state["bodies"].append((request.path, await request.json()))
        if request.path == "/v1/completions":
            choice = {"index": 0, "token_ids": [5], "logprobs": {"token_logprobs": [-1.0]}, "text": "x"}
            return web.json_response({"choices": [choice]})
        ok = state["status"] == 200
        return web.Response(status=state["status"], text="Success" if ok else "LoRA is not enabled")

    for path in ("/v1/completions", "/v1/load_lora_adapter", "/v1/unload_lora_adapter"):
        app.router.add_post(path, handler)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    yield state, f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
    await runner.cleanup()


async def test_the_client_loads_unloads_and_names_adapters(adapter_server):
    app, url = adapter_server
    async with VLLMClient(url, backoff_s=0.01) as c:
        await c.load_lora_adapter("run@v1", "/w/v1")
        await c.unload_lora_adapter("run@v1")
        await c.complete([1, 2], max_tokens=1, model="run@v1")
        await c.complete([1, 2], max_tokens=1)
        app["status"] = 500  # a failed load is final: no retries, vLLM's message in the error
        with pytest.raises(InferenceHTTPError, match="LoRA is not enabled") as e:
            await c.load_lora_adapter("run@v2", "/w/v2")
    assert e.value.status == 500
    assert [(p, b.get("lora_name", b.get("model"))) for p, b in app["bodies"]] == [
        ("/v1/load_lora_adapter", "run@v1"), ("/v1/unload_lora_adapter", "run@v1"),
        ("/v1/completions", "run@v1"), ("/v1/completions", "policy"), ("/v1/load_lora_adapter", "run@v2")]  # fmt: skip
    assert app["bodies"][0][1] == {"lora_name": "run@v1", "lora_path": "/w/v1"}


def test_evaluation_finds_a_lora_checkpoints_adapter_and_its_base(tmp_path):
    from grpoflow.flows.config import GRPOConfig
    from grpoflow.flows.lineage.evaluate import adapter_base, model_for
    from grpoflow.storage.checkpoints import CheckpointStore

    def checkpoint(d):
        (d / "adapter").mkdir()
        adapter(rank=12)(d / "adapter")
        (d / "learner.json").write_text(json.dumps({"base_model": "/models/base"}))

    ckpt = CheckpointStore(tmp_path).save("lo", 5, checkpoint, {})
    cfg = GRPOConfig.model_validate({"storage": {"root": str(tmp_path)}})
    assert model_for(cfg, "lo", None) == (str(ckpt / "adapter"), 5)
    assert model_for(cfg, None, str(ckpt)) == (str(ckpt / "adapter"), 5)
    assert model_for(cfg, None, str(ckpt / "adapter")) == (str(ckpt / "adapter"), 0)
    base, lora = adapter_base(cfg, str(ckpt / "adapter"))
    assert base == "/models/base" and lora.served_rank() == 16
    assert adapter_base(cfg, str(tmp_path)) is None  # a model dir: served as it is


def test_every_sync_backend_the_config_accepts_has_a_push():
    from typing import get_args

    from grpoflow.tasks.config.choices import SyncBackend
    from grpoflow.tasks.push.push import BACKENDS

    assert set(BACKENDS) == set(get_args(SyncBackend))

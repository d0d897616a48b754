"""`policy-server`: the long-lived Prefect flow that serves a lineage's policy (flows/processes/serve.py
starts it), supervised: restarted when it dies, a pause whose trainer died resumed."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from pathlib import Path

from prefect import flow, get_run_logger

from grpoflow.flows.processes.launch import ServerHandle, ServerStartError, _tail
from grpoflow.flows.processes.serve import VLLMServer, upload_dir_of
from grpoflow.flows.processes.vllm_command import server_command
from grpoflow.storage.processes import stop_stale
from grpoflow.tasks.config.learner import LoraConfig


async def _release_abandoned_pause(url: str, api_key: str | None) -> str | None:
    from grpoflow.tasks.push.push import release_abandoned_pause
    from grpoflow.tasks.rollouts.inference import VLLMClient
    from grpoflow.tasks.rollouts.inference_api import InferenceError

    try:
        async with VLLMClient(url, api_key=api_key, retries=0) as client:
            return await release_abandoned_pause(client)
    except InferenceError:  # a server mid-restart: the health check deals with it
        return None


def served_model_dir(root: str | Path, lineage: str | None, model_dir: str | None) -> str:
    """What a policy server of `lineage` serves: the version its promotion log says (a promoted
    checkpoint, or the base model it rolled back to), else `model_dir`."""
    if lineage is not None:
        from grpoflow.storage.ids import validate_run_id
        from grpoflow.storage.promotions import PromotionLog

        serving = PromotionLog(root).serving(validate_run_id(lineage))
        if serving is not None:
            return serving["path"]
    if model_dir is None:
        raise ValueError(f"policy-server: lineage {lineage!r} has no promotion under {root}; give model_dir")
    return model_dir


def lora_lineages(root: str | Path, lineages: list[str], model_dir: str | None) -> tuple[str, dict[str, str]]:
    """(the base model a LoRA server starts on, {lineage: the adapter its name serves}) for lineages
    that share one server; a lineage with no decision yet is left out (its name is not served until
    its first promotion loads it). The base: `model_dir`, else the base of the first adapter."""
    from grpoflow.flows.lineage.promote import adapter_base_model, lineage_adapter
    from grpoflow.storage.ids import validate_run_id

    adapters = {name: a for name in lineages if (a := lineage_adapter(root, validate_run_id(name)))}
    base = model_dir or next((b for a in adapters.values() if (b := adapter_base_model(a))), None)
    if base is None:
        raise ValueError(f"policy-server: no base model for lineages {lineages} under {root}; give model_dir")
    return base, adapters


def _serve_lineages(url: str, api_key: str | None, adapters: dict[str, str]) -> None:
    """Load each lineage's adapter under its name (again after a restart: the registry is gone)."""
    from grpoflow.tasks.push.lora_serve import serve_lineage
    from grpoflow.tasks.rollouts.inference import VLLMClient

    async def go() -> None:
        async with VLLMClient(url, api_key=api_key) as client:
            for name, path in adapters.items():
                await serve_lineage(url, client, name, path)

    asyncio.run(go())


def _what_to_serve(
    root: str, model_dir: str | None, lineage: str | None, lineages: list[str] | None, lora_rank: int | None
) -> tuple[str, dict[str, str]]:
    """The model dir the server starts on and the adapters it loads by name (LoRA lineages), each one
    inside the worker's allowed roots."""
    from grpoflow.tasks.config.allowlist import check_path

    log = get_run_logger()
    check_path(root, "root")
    adapters: dict[str, str] = {}
    if lora_rank is not None:
        model_dir, adapters = lora_lineages(
            root, [*([lineage] if lineage else []), *(lineages or [])], model_dir
        )
        log.info("LoRA server on %s; lineages served by name: %s", model_dir, adapters or "none yet")
    else:
        model_dir = served_model_dir(root, lineage, model_dir)
        if lineage is not None:
            log.info("lineage %s serves %s", lineage, model_dir)
    check_path(model_dir, "model_dir")  # a worker-started server loads only from its allowed roots
    for adapter in adapters.values():
        check_path(adapter, "adapter")
    return model_dir, adapters


def _server_handle(
    model_dir: str,
    root: str,
    host: str,
    port: int,
    api_key: str | None,
    max_model_len: int | None,
    lora_rank: int | None,
    max_loras: int,
) -> VLLMServer:
    """The vLLM server to start on `port` (not started yet)."""
    # <root>/pids/serve-<port>.json: a server a dead policy-server left on this port is stopped first;
    # versions uploaded to it (from a learner on another host) go to <root>/uploads/serve-<port>/
    pid_file = (Path(root), f"serve-{port}")
    cmd, env, url = server_command(
        model_dir,
        host=host,
        port=port,
        api_key=api_key,
        max_model_len=max_model_len,
        lora_rank=lora_rank,
        max_loras=max_loras,
        upload_dir=upload_dir_of(*pid_file),
    )
    stop_stale(*pid_file)
    return VLLMServer(cmd, env, url, Path(model_dir).parent / f"vllm-{port}.log", 600.0, pid_file)


@flow(name="policy-server", log_prints=True)
def policy_server(
    model_dir: str | None = None,
    lineage: str | None = None,
    host: str = "127.0.0.1",
    port: int = 8000,
    api_key: str | None = None,
    max_model_len: int | None = None,
    max_restarts: int = 3,
    check_every_s: float = 5.0,
    run_for_s: float | None = None,
    stop_file: str | None = None,
    root: str = "runs",
    lora_rank: int | None = None,
    lineages: list[str] | None = None,
    max_loras: int = 4,
) -> dict:
    """Start the vLLM server and keep it up: restart on crash (bounded, with backoff), also when it
    dies while still starting. `lineage`: serve what the lineage's promotion log says it serves (its
    promoted version, or the base model it rolled back to); `model_dir` until it has a decision.

    `lora_rank`: a LoRA server shared by LoRA lineages (`lineages`, and `lineage`): started on the base
    model (`model_dir`, else the lineages' adapters' base) with adapters up to this rank loadable at
    runtime, `max_loras` per batch; each lineage's adapter is loaded under its name at start and after
    every restart, and promotions and rollbacks (`--server`) replace it there.

    `api_key` (needed off loopback): default $GRPOFLOW_API_KEY of the worker that runs it, so that the
    key is no parameter the UI shows. `host`: the address it binds (another host's learner needs this
    host's address, not the default 127.0.0.1); versions pushed over the network land in
    <root>/uploads/serve-<port>/."""
    log = get_run_logger()
    from grpoflow.tasks.config.inference import api_key_from_env

    api_key = api_key or api_key_from_env()  # the worker's, not a parameter
    model_dir, adapters = _what_to_serve(root, model_dir, lineage, lineages, lora_rank)
    served_rank = lora_rank and LoraConfig(rank=lora_rank).served_rank()
    handle = _server_handle(model_dir, root, host, port, api_key, max_model_len, served_rank, max_loras)
    on_up = (lambda: _serve_lineages(handle.url, api_key, adapters)) if adapters else None
    supervisor = Supervisor(handle, api_key, max_restarts, on_up)
    supervisor.bring_up()
    log.info("vLLM server up at %s", handle.url)
    try:
        supervisor.watch(check_every_s, run_for_s, stop_file)
    finally:
        handle.stop()
    return {"url": handle.url, "restarts": handle.restarts}


class Supervisor:
    """Keeps a server up: restarts it when it dies or fails its health check (at most
    `max_restarts` times, with backoff), and resumes a pause whose owner's lease ran out."""

    def __init__(
        self,
        handle: ServerHandle,
        api_key: str | None,
        max_restarts: int,
        on_up: Callable[[], None] | None = None,
    ):
        self.handle, self.api_key, self.max_restarts, self.on_up = handle, api_key, max_restarts, on_up
        self.log = get_run_logger()

    def restart_or_give_up(self, why: str) -> None:
        h = self.handle
        if h.restarts >= self.max_restarts:
            raise RuntimeError(
                f"vLLM server died {h.restarts + 1} times ({why}); giving up. Log tail:\n{_tail(h.log_path)}"
            )
        h.restarts += 1
        self.log.warning("vLLM server down (%s); restart %d/%d", why, h.restarts, self.max_restarts)
        h.stop()
        time.sleep(min(30.0, 2.0 ** (h.restarts - 1)))

    def bring_up(self) -> None:
        """Start the server; one that dies while still starting counts as a restart."""
        while True:
            try:
                self.handle.start()
                if self.on_up is not None:  # a LoRA server's lineages, loaded under their names
                    try:
                        self.on_up()
                    except BaseException:
                        self.handle.stop()
                        raise
                return
            except ServerStartError as e:
                self.restart_or_give_up(str(e).splitlines()[0])

    def watch(self, check_every_s: float, run_for_s: float | None, stop_file: str | None) -> None:
        """Check every `check_every_s` until `run_for_s` passes or `stop_file` exists (None: forever)."""
        h, started = self.handle, time.monotonic()
        while run_for_s is None or time.monotonic() - started < run_for_s:
            time.sleep(check_every_s)
            if stop_file and Path(stop_file).exists():
                return
            if h.alive() and h.healthy():
                owner = asyncio.run(_release_abandoned_pause(h.url, self.api_key))
                if owner is not None:
                    self.log.warning("vLLM server was left paused by %s past its lease; resumed it", owner)
                continue
            self.restart_or_give_up("not alive" if not h.alive() else "health check failed")
            self.bring_up()

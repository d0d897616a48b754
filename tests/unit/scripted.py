"""A SCRIPTED FAKE vLLM backend for the rollout tests: the real tokenizer, scripted model output. It stands
in for the server only where a test must control what the model says (tool calls, lengths); the
integration tests drive the real server.

It also answers the LoRA adapter calls the `lora` weight push makes, as vLLM 0.32 does (status codes
and messages), and the model-name aliases of grpoflow's middleware in the server
(grpoflow.server.alias), so a push, a lineage's swap and generation can run against one
scripted server."""

from __future__ import annotations

import json
from pathlib import Path

from grpoflow.tasks.rollouts.inference_api import Choice, InferenceHTTPError
from grpoflow.tasks.rollouts.replicas import Replica, ReplicaSet, Servers

BASE = "policy"  # the served model name grpoflow starts vLLM with


class ScriptedBackend:
    """FAKE vLLM backend: answers each request with the next scripted text for that rollout.

    `script(prompt_text, turn, seed)` returns the text the "model" says; it is tokenised with the
    real tokenizer and ends with EOS unless it hits max_tokens. Logprobs are -0.01 * position.

    LoRA: `max_lora_rank` None is a server started without LoRA (`route` False: also without
    VLLM_ALLOW_RUNTIME_LORA_UPDATING, so the load route is missing); `adapters` maps the names it holds
    to their paths, `aliases` alias names to the adapter names they stand for; `calls` records every
    load, unload and alias change. A request naming a model it does not hold (an alias: its target)
    is refused with vLLM's 404; `in_flight` is what the alias middleware reports, `in_flight_polls` how
    often it was asked (a test waits on that, not on a sleep). Usable as its own control client
    (`async with`).
    """

    def __init__(self, tok, script, max_len=1024, *, max_lora_rank: int | None = 64, route: bool = True):
        self.tok, self.script, self.max_len = tok, script, max_len
        self.requests: list[dict] = []
        self.base_url = "http://scripted.invalid"
        self.max_lora_rank, self.route = max_lora_rank, route
        self.adapters: dict[str, str] = {}
        self.calls: list[tuple[str, str]] = []
        self.aliases_: dict[str, str] = {}
        self.in_flight: dict[str, int] = {}
        self.in_flight_polls = 0

    async def __aenter__(self) -> ScriptedBackend:
        return self

    async def __aexit__(self, *exc: object) -> None:
        return None

    async def max_model_len(self) -> int:
        return self.max_len

    async def probe(self, path: str) -> dict:
        """grpoflow's transport probe, as a server on this host answers it (uploads off)."""
        import hashlib
        from pathlib import Path

        data = Path(path).read_bytes() if Path(path).is_file() else None
        return {"sha256": data and hashlib.sha256(data).hexdigest(), "uploads": False}

    async def complete(
        self, prompt_ids, *, max_tokens, temperature=1.0, top_p=1.0, seed=None, n=1, model=None, **_
    ):
        assert len(prompt_ids) + max_tokens <= self.max_len, "request would exceed max_model_len"
        model = self.aliases_.get(model, model)
        if model not in (None, BASE) and model not in self.adapters:
            self._refuse(404, f"The model `{model}` does not exist.", "/v1/completions")
        self.requests.append(
            {
                "prompt_len": len(prompt_ids),
                "max_tokens": max_tokens,
                "seed": seed,
                "cache_salt": _.get("cache_salt"),
                "model": model,
            }
        )
        text = self.tok.decode(prompt_ids)
        out = []
        for k in range(n):
            said = await self.script(text, k, seed)
            ids = self.tok.encode(said, add_special_tokens=False) + [self.tok.eos_token_id]
            reason = "stop"
            if len(ids) > max_tokens:
                ids, reason = ids[:max_tokens], "length"
            out.append(Choice(ids, [-0.01 * (i + 1) for i in range(len(ids))], reason, self.tok.decode(ids)))
        return out

    # -- the LoRA adapter calls (tasks.inference.VLLMClient's) ---------------------------------------

    async def load_lora_adapter(self, name: str, path: str) -> None:
        where = "/v1/load_lora_adapter"
        if not self.route:
            self._refuse(404, '{"detail":"Not Found"}', where)
        self.calls.append(("load", name))
        if self.max_lora_rank is None:
            self._refuse(500, "LoRA is not enabled. Use --enable-lora to enable LoRA.", where)
        if name in self.adapters:
            self._refuse(400, f"The lora adapter '{name}' has already been loaded. If you want to load "
                         "the adapter in place, set 'load_inplace' to True.", where)  # fmt: skip
        rank = json.loads((Path(path) / "adapter_config.json").read_text())["r"]
        if rank > self.max_lora_rank:
            self._refuse(500, f"LoRA rank {rank} is greater than max_lora_rank {self.max_lora_rank}.", where)
        self.adapters[name] = str(path)

    async def unload_lora_adapter(self, name: str) -> None:
        self.calls.append(("unload", name))
        if name not in self.adapters:
            self._refuse(404, f"The lora adapter '{name}' cannot be found.", "/v1/unload_lora_adapter")
        del self.adapters[name]

    async def models(self) -> list[dict]:
        cards = [{"id": n, "root": p, "parent": BASE} for n, p in self.adapters.items()]
        cards += [
            {"id": a, "root": self.adapters[t], "parent": BASE}
            for a, t in self.aliases_.items()
            if t in self.adapters
        ]
        return [{"id": BASE, "root": "/base", "max_model_len": self.max_len}, *cards]

    # -- grpoflow's alias middleware ----------------------------------------------------------------

    async def set_alias(self, name: str, target: str | None) -> str | None:
        self.calls.append(("alias", f"{name}->{target}"))
        previous = self.aliases_.pop(name, None) if target is None else self.aliases_.get(name)
        if target is not None:
            self.aliases_[name] = target
        return previous

    async def aliases(self) -> dict[str, str]:
        return dict(self.aliases_)

    async def alias_in_flight(self) -> dict[str, int]:
        self.in_flight_polls += 1
        return dict(self.in_flight)

    async def reset_prefix_cache(self, *, running: bool = True) -> bool:
        self.calls.append(("reset_prefix_cache", str(running)))
        return True

    def _refuse(self, status: int, message: str, path: str):
        body = (
            message
            if message.startswith("{")
            else json.dumps({"error": {"message": message, "code": status}})
        )
        raise InferenceHTTPError(status, body, f"{self.base_url}{path}")


def one_server(backend, version: int = 0) -> Servers:
    """The run's servers: one, answered by the FAKE `backend`, serving weights `version`."""
    return Servers(ReplicaSet([Replica(0, "http://scripted.invalid")], version=version), [backend])


def tool_call(name: str, **arguments) -> str:
    """What a model writes to call a tool (the Hermes format HermesToolParser reads)."""
    return f"<tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call>"


def scripted_groups(tok, script, rows: list[dict], tools, *, group_size: int = 2, max_turns: int = 3) -> list:
    """`generate_groups` over `rows` with `tools` (a ToolsConfig), answered by the FAKE backend's `script`."""
    import asyncio

    import grpoflow.tasks.rollouts.generate as gen
    from grpoflow.tasks.config.rollouts import GenerationConfig

    return asyncio.run(
        gen.generate_groups(
            rows,
            list(range(len(rows))),
            servers=one_server(ScriptedBackend(tok, script, 4096)),
            tokenizer=tok,
            generation=GenerationConfig(group_size=group_size, max_tokens=64, max_turns=max_turns),
            tools=tools,
            seed=0,
        )
    )

"""aiohttp client for the vLLM server: completions with token ids + logprobs, pause/resume, reload.

One `ClientSession`, `aiohttp.ClientTimeout` objects everywhere, a semaphore bounding requests in
flight, and one retry policy for GET and POST: exponential backoff with jitter on connection errors,
timeouts and 5xx; never on other 4xx (their body is in the exception). When retries run out the
caller gets `InferenceUnavailableError`, never a silent None. A 2xx answer whose body is not the JSON
the method needs raises `InferenceProtocolError`, never a TypeError/KeyError from deep inside.

Prefix cache and weight pushes: a reload with `pause(mode="keep")` does not clear vLLM's prefix cache,
so KV computed under the old weights would be reused by new requests with the same prompt prefix.
Generation therefore salts every request with `cache_salt_for(version)`: the weight push draws a new
salt for each version it loads (`renew_cache_salt`), so no request after a reload can hit KV blocks
computed before it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import secrets
import threading
from dataclasses import dataclass
from typing import Any

import aiohttp

from grpoflow.tasks.config.inference import InferenceConfig


class InferenceError(RuntimeError):
    """Base class of client errors."""


class InferenceHTTPError(InferenceError):
    """The server answered with a status the call does not retry (4xx other than 408/429, or a 5xx
    the call treats as final, e.g. a 500 to an adapter load)."""

    def __init__(self, status: int, body: str, url: str):
        super().__init__(f"{url} answered HTTP {status}: {body[:2000]}")
        self.status, self.body, self.url = status, body, url


class InferenceUnavailableError(InferenceError):
    """Retries ran out on connection errors, timeouts or 5xx."""


def already_loaded(e: InferenceHTTPError) -> bool:
    """Whether vLLM refused an adapter load because it holds an adapter of that name already."""
    return e.status == 400 and "already been loaded" in e.body


class InferenceProtocolError(InferenceError):
    """The server answered 2xx with a body that is not what the API promises (empty, not JSON, or
    JSON without the expected fields): a proxy in the way, or an incompatible server version."""


RETRY_STATUS = frozenset({408, 429, 500, 502, 503, 504})
# The method grpoflow's worker extension adds to vLLM's workers (flows/vllm_plugins/grpoflow_merge.py).
MERGE_LORA_RPC = "grpoflow_merge_lora"


_NO_GATE = contextlib.nullcontext()  # supports `async with`, and is reusable

# -- prefix-cache salt per policy version ----------------------------------------------------------

# vLLM (0.32) accepts a salt of at most 128 characters without '@', '/', '\\' or NUL.
_PROCESS_NONCE = secrets.token_hex(4)
_salts: dict[int, str] = {}
_salts_lock = threading.Lock()


def cache_salt_for(version: int) -> str:
    """The `cache_salt` of a completion request generated under policy `version`.

    Requests with the same salt share prefix-cache blocks; different salts never do. The salt is the
    one the last weight push of `version` in this process drew (`renew_cache_salt`), so pushing the
    same version number again with other weights (a resumed run, a second run against the same
    server) still gets a fresh cache. Without a push in this process (weights the server started
    with) it is fixed for the process."""
    with _salts_lock:
        return _salts.get(version) or f"policy-v{version}-{_PROCESS_NONCE}"


def renew_cache_salt(version: int) -> str:
    """Draw a new salt for `version`: called by the weight push once the server holds its weights."""
    salt = f"policy-v{version}-{secrets.token_hex(8)}"
    with _salts_lock:
        _salts[version] = salt
    return salt


@dataclass
class Choice:
    token_ids: list[int]  # [N] generated tokens
    logprobs: list[float]  # [N] processed (post-temperature) logprob of each generated token
    finish_reason: str  # "stop" | "length" | "abort"
    text: str


@dataclass(frozen=True)
class Usage:
    """Token counts of one completion request (None where the server did not report them)."""

    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    # Prompt tokens served from the prefix cache; reported only with --enable-prompt-tokens-details.
    cached_tokens: int | None = None


def _int_or_none(x: Any) -> int | None:
    return x if isinstance(x, int) and not isinstance(x, bool) else None


def _json_object(text: str, where: str, required: tuple[str, ...] = ()) -> dict[str, Any]:
    """A 2xx body as a JSON object holding `required`; InferenceProtocolError otherwise."""
    if not text.strip():
        raise InferenceProtocolError(f"{where} answered 2xx with an empty body; expected a JSON object")
    try:
        data = json.loads(text)
    except ValueError as e:
        raise InferenceProtocolError(
            f"{where} answered 2xx with a body that is not JSON ({e}): {text[:300]!r}"
        ) from None
    if not isinstance(data, dict):
        raise InferenceProtocolError(f"{where} answered 2xx with JSON that is not an object: {text[:300]!r}")
    missing = [k for k in required if k not in data]
    if missing:
        raise InferenceProtocolError(f"{where} answered 2xx with JSON without {missing}: {text[:300]!r}")
    return data


class VLLMClient:
    def __init__(
        self,
        base_url: str,
        *,
        model: str = "policy",
        api_key: str | None = None,
        max_in_flight: int = 32,
        retries: int = 4,
        backoff_s: float = 0.5,
        backoff_max_s: float = 8.0,
        connect_timeout_s: float = 5.0,
        request_timeout_s: float = 600.0,
        control_timeout_s: float = 120.0,
    ):
        self.base_url = base_url.rstrip("/")
        self.model = model
        self.api_key = api_key
        self.retries = retries
        self.backoff_s, self.backoff_max_s = backoff_s, backoff_max_s
        # Generation may legitimately take minutes (long outputs, paused for a weight push);
        # control calls (health, pause, reload) get their own, shorter budget.
        self.gen_timeout = aiohttp.ClientTimeout(total=request_timeout_s, sock_connect=connect_timeout_s)
        self.control_timeout = aiohttp.ClientTimeout(total=control_timeout_s, sock_connect=connect_timeout_s)
        self.max_in_flight = max_in_flight
        self._sem: asyncio.Semaphore | None = None
        self._session: aiohttp.ClientSession | None = None
        self._max_model_len: int | None = None

    # -- session ------------------------------------------------------------------------------

    def _get_session(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
            connector = aiohttp.TCPConnector(limit=self.max_in_flight + 4)
            self._session = aiohttp.ClientSession(headers=headers, connector=connector)
            self._sem = asyncio.Semaphore(self.max_in_flight)
        return self._session

    async def close(self) -> None:
        if self._session is not None and not self._session.closed:
            await self._session.close()

    async def __aenter__(self) -> VLLMClient:
        self._get_session()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # -- transport ----------------------------------------------------------------------------

    async def _request(
        self,
        method: str,
        path: str,
        *,
        json_body: Any = None,
        params: dict[str, str] | None = None,
        timeout: aiohttp.ClientTimeout | None = None,
        retries: int | None = None,
        limited: bool = False,
        headers: dict[str, str] | None = None,
        retry_status: frozenset[int] = RETRY_STATUS,
    ) -> str:
        """The body of a 2xx answer, as text (callers that need JSON parse it with `_json_object`).
        An answer whose status is not in `retry_status` raises InferenceHTTPError with its body."""
        session = self._get_session()
        url = f"{self.base_url}{path}"
        attempts = (self.retries if retries is None else retries) + 1
        last: str = ""
        for attempt in range(attempts):
            try:
                # Only generation is bounded: a control call (pause/resume) must never queue behind
                # generation requests that are themselves held by a pause.
                gate = self._sem if limited and self._sem is not None else _NO_GATE
                async with (
                    gate,
                    session.request(
                        method,
                        url,
                        json=json_body,
                        params=params,
                        headers=headers,
                        timeout=timeout or self.control_timeout,
                    ) as resp,
                ):
                    text = await resp.text()
                    if resp.status < 400:
                        return text
                    if resp.status not in retry_status:
                        raise InferenceHTTPError(resp.status, text, url)
                    last = f"HTTP {resp.status}: {text[:300]}"
            except (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError, TimeoutError) as e:
                last = f"{type(e).__name__}: {e}"
            if attempt + 1 < attempts:
                delay = min(self.backoff_max_s, self.backoff_s * 2**attempt)
                await asyncio.sleep(delay * (0.5 + random.random() / 2))  # jitter: no thundering herd
        raise InferenceUnavailableError(
            f"{method} {url} failed after {attempts} attempts; last error: {last}"
        )

    # -- API ----------------------------------------------------------------------------------

    async def complete(self, prompt_ids: list[int], **kwargs: Any) -> list[Choice]:
        """`n` completions of one token-id prompt, with the sampled token ids and their logprobs
        (`complete_with_usage` without the usage; the same parameters)."""
        choices, _ = await self.complete_with_usage(prompt_ids, **kwargs)
        return choices

    async def complete_with_usage(
        self,
        prompt_ids: list[int],
        *,
        max_tokens: int,
        temperature: float = 1.0,
        top_p: float = 1.0,
        seed: int | None = None,
        n: int = 1,
        stop: list[str] | None = None,
        stop_token_ids: list[int] | None = None,
        cache_salt: str | None = None,
        model: str | None = None,
        **sampling: Any,
    ) -> tuple[list[Choice], Usage]:
        """`n` completions of one token-id prompt, plus the request's token usage (e.g. how many
        prompt tokens the prefix cache served).

        `cache_salt`: requests share prefix-cache blocks only with requests of the same salt; pass
        `cache_salt_for(version)` so that no request reuses KV computed under other weights.
        `model`: the model the request names instead of the client's (a LoRA adapter's name).
        Further keyword arguments are vLLM sampling parameters passed through as they are (e.g.
        `ignore_eos=True`, `min_tokens`, `repetition_penalty`)."""
        body = self._completion_body(
            prompt_ids, max_tokens, temperature, top_p, n, seed, stop, stop_token_ids, cache_salt, sampling
        )
        if model is not None:
            body["model"] = model
        text = await self._request(
            "POST", "/v1/completions", json_body=body, timeout=self.gen_timeout, limited=True
        )
        where = f"POST {self.base_url}/v1/completions"
        data = _json_object(text, where, ("choices",))
        try:
            raw = sorted(data["choices"], key=lambda c: c["index"])
            choices = [self._choice(c) for c in raw]
        except (TypeError, KeyError, AttributeError, ValueError) as e:
            raise InferenceProtocolError(
                f"{where} answered 2xx with malformed choices ({type(e).__name__}: {e}): {text[:300]!r}"
            ) from None
        return choices, self._usage(data.get("usage"))

    def _completion_body(
        self, prompt_ids, max_tokens, temperature, top_p, n, seed, stop, stop_token_ids, cache_salt, sampling
    ) -> dict[str, Any]:
        body: dict[str, Any] = {
            "model": self.model,
            "prompt": prompt_ids,
            "max_tokens": max_tokens,
            "temperature": temperature,
            "top_p": top_p,
            "n": n,
            "logprobs": 0,  # logprob of the sampled token only
            "return_token_ids": True,
            "skip_special_tokens": False,
        }
        optional = {"seed": seed, "stop": stop, "stop_token_ids": stop_token_ids, "cache_salt": cache_salt}
        body.update({k: v for k, v in optional.items() if v is not None and v != []})
        clash = sorted(set(sampling) & set(body))
        if clash:
            raise ValueError(f"sampling parameters {clash} are set by complete() itself")
        return body | sampling

    @staticmethod
    def _choice(c: dict[str, Any]) -> Choice:
        ids = [int(t) for t in c.get("token_ids") or []]
        lp = (c.get("logprobs") or {}).get("token_logprobs") or []
        if len(lp) != len(ids):
            raise InferenceProtocolError(f"server returned {len(ids)} token ids but {len(lp)} logprobs")
        # vLLM may report -inf for a token the processed distribution excluded; keep it finite.
        logprobs = [float(x) if x is not None and x != float("-inf") else -1e4 for x in lp]
        return Choice(ids, logprobs, c.get("finish_reason") or "stop", c.get("text") or "")

    @staticmethod
    def _usage(u: Any) -> Usage:
        if not isinstance(u, dict):
            return Usage()
        details = u.get("prompt_tokens_details")
        cached = details.get("cached_tokens") if isinstance(details, dict) else None
        return Usage(
            _int_or_none(u.get("prompt_tokens")),
            _int_or_none(u.get("completion_tokens")),
            _int_or_none(cached),
        )

    async def health(self) -> bool:
        try:
            await self._request("GET", "/health", retries=0)
            return True
        except InferenceError:
            return False

    async def wait_healthy(self, timeout_s: float) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while loop.time() < deadline:
            if await self.health():
                return
            await asyncio.sleep(0.5)
        raise InferenceUnavailableError(f"{self.base_url}/health not ready after {timeout_s}s")

    async def models(self) -> list[dict[str, Any]]:
        where = f"GET {self.base_url}/v1/models"
        text = await self._request("GET", "/v1/models")
        data = _json_object(text, where, ("data",))["data"]
        if not isinstance(data, list) or not all(isinstance(m, dict) for m in data):
            raise InferenceProtocolError(f"{where}: 'data' is not a list of objects: {text[:300]!r}")
        return data

    async def max_model_len(self) -> int:
        if self._max_model_len is None:
            models = await self.models()
            match = [m for m in models if m.get("id") == self.model] or models
            try:
                self._max_model_len = int(match[0]["max_model_len"])
            except (IndexError, KeyError, TypeError, ValueError) as e:
                raise InferenceProtocolError(
                    f"GET {self.base_url}/v1/models: no max_model_len for model {self.model!r} "
                    f"({type(e).__name__}: {e}); models: {models!r:.300}"
                ) from None
        return self._max_model_len

    async def pause(
        self,
        mode: str = "keep",
        clear_cache: bool = False,
        owner: str | None = None,
        lease_s: float | None = None,
    ) -> None:
        """Pause generation. `owner` and `lease_s` go to grpoflow's lease middleware in the server: a
        supervisor resumes a pause only once its lease has run out (its owner died mid-push)."""
        params = {"mode": mode, "clear_cache": str(clear_cache).lower()}
        if owner is not None:
            params["owner"] = owner
        if lease_s is not None:
            params["lease_s"] = f"{lease_s:.3f}"
        await self._request("POST", "/pause", params=params)

    async def pause_lease(self) -> dict[str, Any]:
        """Who paused the server and for how much longer: {"owner", "expires_in_s", "paused_at"}."""
        text = await self._request("GET", "/grpoflow/pause_lease")
        return _json_object(text, f"GET {self.base_url}/grpoflow/pause_lease", ("owner", "expires_in_s"))

    async def resume(self) -> None:
        await self._request("POST", "/resume")

    async def reset_prefix_cache(self, *, running: bool = True) -> bool:
        """Drop the server's prefix cache, for every client. `running`: requests in flight are
        preempted and recomputed (under the weights loaded now) so none keeps KV of the old ones.
        False when vLLM could not reset it (blocks still held); the caller may retry."""
        text = await self._request(
            "POST", "/reset_prefix_cache", params={"reset_running_requests": str(running).lower()}
        )
        return bool(_json_object(text, f"POST {self.base_url}/reset_prefix_cache", ("success",))["success"])

    async def is_paused(self) -> bool:
        text = await self._request("GET", "/is_paused")
        value = _json_object(text, f"GET {self.base_url}/is_paused", ("is_paused",))["is_paused"]
        if not isinstance(value, bool):
            raise InferenceProtocolError(
                f"GET {self.base_url}/is_paused: 'is_paused' is not a bool: {text!r:.300}"
            )
        return value

    async def load_lora_adapter(self, name: str, path: str) -> None:
        """Load the PEFT adapter in `path` under `name` (requests naming `name` are served by it).
        Never with vLLM's `load_inplace`: vLLM keeps that flag on the registered adapter and re-reads
        its files at every engine step that runs it; a name is re-pointed with `set_alias` instead.

        vLLM answers a name it already holds with 400 and a failed load with 500 (the adapter's files,
        or a server that cannot take it): both are final, raised as InferenceHTTPError with vLLM's
        message; a route the server lacks (started without VLLM_ALLOW_RUNTIME_LORA_UPDATING) is a 404.
        Retried only on connection errors, timeouts and the other retryable statuses."""
        body: dict[str, Any] = {"lora_name": name, "lora_path": str(path)}
        await self._request(
            "POST", "/v1/load_lora_adapter", json_body=body, retry_status=RETRY_STATUS - {500}
        )

    async def unload_lora_adapter(self, name: str) -> None:
        """Remove `name` from the server's adapters: new requests naming it are refused (404), requests
        already running keep it. A name the server does not hold answers 404 (InferenceHTTPError)."""
        await self._request("POST", "/v1/unload_lora_adapter", json_body={"lora_name": name})

    async def set_alias(self, name: str, target: str | None) -> str | None:
        """Point the model name `name` at the loaded adapter (or model) `target`: requests naming
        `name` are served by `target` from the next one on; None removes the alias. grpoflow's alias
        middleware in the server (flows/vllm_plugins/grpoflow_alias.py); a server without it answers
        404 (InferenceHTTPError). The target `name` pointed at before, or None."""
        text = await self._request(
            "POST",
            "/grpoflow/alias",
            json_body={"name": name, "target": target},
            retry_status=RETRY_STATUS - {500},
        )
        return _json_object(text, f"POST {self.base_url}/grpoflow/alias", ("previous",))["previous"]

    async def aliases(self) -> dict[str, str]:
        """The server's alias table {name: target}."""
        return (await self._alias_state())["aliases"]

    async def alias_in_flight(self) -> dict[str, int]:
        """{target: requests sent to it through an alias whose answer has not ended yet}."""
        return (await self._alias_state())["in_flight"]

    async def _alias_state(self) -> dict[str, Any]:
        where = f"GET {self.base_url}/grpoflow/aliases"
        state = _json_object(await self._request("GET", "/grpoflow/aliases"), where, ("aliases", "in_flight"))
        if not isinstance(state["aliases"], dict) or not isinstance(state["in_flight"], dict):
            raise InferenceProtocolError(
                f"{where}: 'aliases' and 'in_flight' must be objects: {state!r:.300}"
            )
        return state

    async def reload_weights(self, path: str, *, timeout_s: float | None = None) -> Any:
        """Load the weights under `path` into the running model (the server should be paused).

        `timeout_s` bounds this call (default: the client's control timeout); never retried. Returns
        the per-worker results, or None when vLLM answers with an empty body (it does when
        `collective_rpc` returns None).

        On its own connection: vLLM answers a failed reload with a 500 and drops the connection, which
        a pooled connection would only reveal on the next call (a reset, not retried for a reload)."""
        return await self.collective_rpc("reload_weights", {"weights_path": str(path)}, timeout_s)

    async def merge_lora(self, adapter_path: str, *, timeout_s: float | None = None) -> Any:
        """Serve the base model with the PEFT adapter at `adapter_path` merged into its weights (the
        server's `grpoflow_merge` worker extension; paused around it, as for `reload_weights`)."""
        return await self.collective_rpc(MERGE_LORA_RPC, {"adapter_path": str(adapter_path)}, timeout_s)

    async def collective_rpc(self, method: str, kwargs: dict[str, Any], timeout_s: float | None) -> Any:
        """Call `method` on every worker (`reload_weights`' doc: timeout, no retry, own connection)."""
        body = {"method": method, "kwargs": kwargs}
        timeout = (
            aiohttp.ClientTimeout(total=timeout_s, sock_connect=self.control_timeout.sock_connect)
            if timeout_s is not None
            else None
        )
        text = await self._request(
            "POST",
            "/collective_rpc",
            json_body=body,
            retries=0,
            timeout=timeout,
            headers={"Connection": "close"},
        )
        if not text.strip():
            return None
        return _json_object(text, f"POST {self.base_url}/collective_rpc")


def client_for(url: str, inference: InferenceConfig, max_in_flight: int = 32) -> VLLMClient:
    """A client for `url` with the `inference` section's key, retries and request timeout."""
    return VLLMClient(
        url,
        api_key=inference.api_key,
        retries=inference.retries,
        request_timeout_s=inference.request_timeout_s,
        max_in_flight=max_in_flight,
    )

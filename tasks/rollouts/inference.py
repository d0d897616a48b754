"""aiohttp client for the vLLM server: completions with token ids + logprobs, pause/resume, reload.

One `ClientSession`, `aiohttp.ClientTimeout` objects everywhere, a semaphore bounding requests in
flight, and one retry policy for GET and POST: exponential backoff with jitter on connection errors,
timeouts and 5xx; never on other 4xx (their body is in the exception). When retries run out the
caller gets `InferenceUnavailableError`, never a silent None. A 2xx answer whose body is not the JSON
the method needs raises `InferenceProtocolError`, never a TypeError/KeyError from deep inside.

The errors, a completion's records and the parsing of answers are in tasks/rollouts/inference_api.py;
the control endpoints (pause, adapters, aliases, weight loads) in tasks/rollouts/server_control.py;
the prefix-cache salt each request carries in tasks/rollouts/cache_salt.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import socket
from typing import Any

import aiohttp

from grpoflow.tasks.config.inference import InferenceConfig
from grpoflow.tasks.rollouts.inference_api import (
    RETRY_STATUS,
    Choice,
    InferenceError,
    InferenceHTTPError,
    InferenceProtocolError,
    InferenceUnavailableError,
    Usage,
    json_object,
    parse_choice,
    parse_usage,
)
from grpoflow.tasks.rollouts.server_control import ServerControl

_NO_GATE = contextlib.nullcontext()  # supports `async with`, and is reusable


# A server whose machine vanished (powered off, its link down) neither answers nor refuses: a request
# on an open connection would wait out its whole timeout (minutes: generation may be long). TCP
# keepalive asks the peer's kernel, which answers while the server is busy or paused, so only a peer
# that is gone stops answering: after KEEPALIVE_IDLE_S + KEEPALIVE_COUNT * KEEPALIVE_INTERVAL_S, or
# USER_TIMEOUT_S with data unacknowledged, the connection fails, and the request with it (retried,
# then the server leaves the rotation: tasks/rollouts/replicas.py).
KEEPALIVE_IDLE_S, KEEPALIVE_INTERVAL_S, KEEPALIVE_COUNT, USER_TIMEOUT_S = 5, 2, 3, 30


def keepalive_socket(addr_info) -> socket.socket:
    """A client socket (aiohttp's `socket_factory`) that notices a vanished peer within seconds."""
    family, kind, proto = addr_info[:3]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for name, value in (
        ("TCP_KEEPIDLE", KEEPALIVE_IDLE_S),
        ("TCP_KEEPINTVL", KEEPALIVE_INTERVAL_S),
        ("TCP_KEEPCNT", KEEPALIVE_COUNT),
        ("TCP_USER_TIMEOUT", USER_TIMEOUT_S * 1000),
    ):
        if hasattr(socket, name):  # Linux has all four; elsewhere keepalive's system defaults
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, name), value)
    return sock


class VLLMClient(ServerControl):
    """The client of one vLLM server: generation and the server's state here, its control endpoints
    from `ServerControl`."""

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
            connector = aiohttp.TCPConnector(limit=self.max_in_flight + 4, socket_factory=keepalive_socket)
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
        data: bytes | None = None,
        params: dict[str, str] | None = None,
        timeout: aiohttp.ClientTimeout | None = None,
        retries: int | None = None,
        limited: bool = False,
        headers: dict[str, str] | None = None,
        retry_status: frozenset[int] = RETRY_STATUS,
    ) -> str:
        """The body of a 2xx answer, as text (callers that need JSON parse it with `json_object`).
        An answer whose status is not in `retry_status` raises InferenceHTTPError with its body.
        `json_body` goes as JSON, `data` as raw bytes (sent again as they are on a retry)."""
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
                        data=data,
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
        data = json_object(text, where, ("choices",))
        try:
            raw = sorted(data["choices"], key=lambda c: c["index"])
            choices = [parse_choice(c) for c in raw]
        except (TypeError, KeyError, AttributeError, ValueError) as e:
            raise InferenceProtocolError(
                f"{where} answered 2xx with malformed choices ({type(e).__name__}: {e}): {text[:300]!r}"
            ) from None
        return choices, parse_usage(data.get("usage"))

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
        data = json_object(text, where, ("data",))["data"]
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


def client_for(url: str, inference: InferenceConfig, max_in_flight: int = 32) -> VLLMClient:
    """A client for `url` with the `inference` section's key, retries and request timeout."""
    return VLLMClient(
        url,
        api_key=inference.api_key,
        retries=inference.retries,
        request_timeout_s=inference.request_timeout_s,
        max_in_flight=max_in_flight,
    )

"""aiohttp client for the vLLM server: completions with token ids + logprobs, pause/resume, reload.

One `ClientSession`, `aiohttp.ClientTimeout` objects everywhere, a semaphore bounding requests in
flight, and one retry policy for GET and POST: exponential backoff with jitter on connection errors,
timeouts and 5xx; never on other 4xx (their body is in the exception). When retries run out the
caller gets `InferenceUnavailableError`, never a silent None.
"""

from __future__ import annotations

import asyncio
import random
from dataclasses import dataclass
from typing import Any

import aiohttp


class InferenceError(RuntimeError):
    """Base class of client errors."""


class InferenceHTTPError(InferenceError):
    """The server answered with a non-retryable status (4xx other than 408/429)."""

    def __init__(self, status: int, body: str, url: str):
        super().__init__(f"{url} answered HTTP {status}: {body[:2000]}")
        self.status, self.body, self.url = status, body, url


class InferenceUnavailableError(InferenceError):
    """Retries ran out on connection errors, timeouts or 5xx."""


RETRY_STATUS = {408, 429, 500, 502, 503, 504}


class _NoGate:
    async def __aenter__(self) -> None:
        return None

    async def __aexit__(self, *exc: object) -> None:
        return None


_NO_GATE = _NoGate()


@dataclass
class Choice:
    token_ids: list[int]  # [N] generated tokens
    logprobs: list[float]  # [N] processed (post-temperature) logprob of each generated token
    finish_reason: str  # "stop" | "length" | "abort"
    text: str


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
    ) -> Any:
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
                        method, url, json=json_body, params=params, timeout=timeout or self.control_timeout
                    ) as resp,
                ):
                    text = await resp.text()
                    if resp.status < 400:
                        if not text:
                            return None
                        ctype = resp.headers.get("Content-Type", "")
                        return await resp.json(content_type=None) if "json" in ctype else text
                    if resp.status not in RETRY_STATUS:
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

    async def complete(
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
        **sampling: Any,
    ) -> list[Choice]:
        """`n` completions of one token-id prompt, with the sampled token ids and their logprobs.

        Further keyword arguments are vLLM sampling parameters passed through as they are (e.g.
        `ignore_eos=True`, `min_tokens`, `repetition_penalty`)."""
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
        if seed is not None:
            body["seed"] = seed
        if stop:
            body["stop"] = stop
        if stop_token_ids:
            body["stop_token_ids"] = stop_token_ids
        clash = sorted(set(sampling) & set(body))
        if clash:
            raise ValueError(f"sampling parameters {clash} are set by complete() itself")
        body.update(sampling)
        data = await self._request(
            "POST", "/v1/completions", json_body=body, timeout=self.gen_timeout, limited=True
        )
        return [self._choice(c) for c in sorted(data["choices"], key=lambda c: c["index"])]

    @staticmethod
    def _choice(c: dict[str, Any]) -> Choice:
        ids = list(c.get("token_ids") or [])
        lp = (c.get("logprobs") or {}).get("token_logprobs") or []
        if len(lp) != len(ids):
            raise InferenceError(f"server returned {len(ids)} token ids but {len(lp)} logprobs")
        # vLLM may report -inf for a token the processed distribution excluded; keep it finite.
        logprobs = [float(x) if x is not None and x != float("-inf") else -1e4 for x in lp]
        return Choice(ids, logprobs, c.get("finish_reason") or "stop", c.get("text") or "")

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
        return (await self._request("GET", "/v1/models"))["data"]

    async def max_model_len(self) -> int:
        if self._max_model_len is None:
            models = await self.models()
            match = [m for m in models if m["id"] == self.model] or models
            self._max_model_len = int(match[0]["max_model_len"])
        return self._max_model_len

    async def pause(self, mode: str = "keep", clear_cache: bool = False) -> None:
        params = {"mode": mode, "clear_cache": str(clear_cache).lower()}
        await self._request("POST", "/pause", params=params)

    async def resume(self) -> None:
        await self._request("POST", "/resume")

    async def is_paused(self) -> bool:
        return bool((await self._request("GET", "/is_paused"))["is_paused"])

    async def reload_weights(self, path: str) -> Any:
        body = {"method": "reload_weights", "kwargs": {"weights_path": str(path)}}
        return await self._request("POST", "/collective_rpc", json_body=body, retries=0)

"""What the vLLM client's callers handle and get back: its errors (`InferenceError` and its family),
a completion's records (`Choice`, `Usage`), and the parsing of the server's answers into them.

A 2xx answer whose body is not the JSON a call needs raises `InferenceProtocolError`, never a
TypeError/KeyError from deep inside (`json_object`, `parse_choice`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any


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


def json_object(text: str, where: str, required: tuple[str, ...] = ()) -> dict[str, Any]:
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


def parse_choice(c: dict[str, Any]) -> Choice:
    """One entry of a completion answer's `choices`."""
    ids = [int(t) for t in c.get("token_ids") or []]
    lp = (c.get("logprobs") or {}).get("token_logprobs") or []
    if len(lp) != len(ids):
        raise InferenceProtocolError(f"server returned {len(ids)} token ids but {len(lp)} logprobs")
    # vLLM may report -inf for a token the processed distribution excluded; keep it finite.
    logprobs = [float(x) if x is not None and x != float("-inf") else -1e4 for x in lp]
    return Choice(ids, logprobs, c.get("finish_reason") or "stop", c.get("text") or "")


def parse_usage(u: Any) -> Usage:
    """A completion answer's `usage`, whatever of it the server reported."""
    if not isinstance(u, dict):
        return Usage()
    details = u.get("prompt_tokens_details")
    cached = details.get("cached_tokens") if isinstance(details, dict) else None
    return Usage(
        _int_or_none(u.get("prompt_tokens")),
        _int_or_none(u.get("completion_tokens")),
        _int_or_none(cached),
    )


def no_such_method(e: InferenceError, method: str) -> bool:
    """vLLM's answer to a `/collective_rpc` call of a method its workers do not have."""
    body = e.body if isinstance(e, InferenceHTTPError) else str(e)  # a 500 is retried, then quoted
    return method in body and ("has no attribute" in body or "is not implemented" in body)

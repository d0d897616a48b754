"""A SCRIPTED FAKE vLLM backend for the rollout tests: the real tokenizer, scripted model output. It stands
in for the server only where a test must control what the model says (tool calls, lengths); the
integration tests drive the real server."""

from __future__ import annotations

from tasks.inference import Choice
from tasks.replicas import Replica, ReplicaSet, Servers


class ScriptedBackend:
    """FAKE vLLM backend: answers each request with the next scripted text for that rollout.

    `script(prompt_text, turn, seed)` returns the text the "model" says; it is tokenised with the
    real tokenizer and ends with EOS unless it hits max_tokens. Logprobs are -0.01 * position.
    """

    def __init__(self, tok, script, max_len=1024):
        self.tok, self.script, self.max_len = tok, script, max_len
        self.requests: list[dict] = []

    async def max_model_len(self) -> int:
        return self.max_len

    async def complete(self, prompt_ids, *, max_tokens, temperature=1.0, top_p=1.0, seed=None, n=1, **_):
        assert len(prompt_ids) + max_tokens <= self.max_len, "request would exceed max_model_len"
        self.requests.append(
            {
                "prompt_len": len(prompt_ids),
                "max_tokens": max_tokens,
                "seed": seed,
                "cache_salt": _.get("cache_salt"),
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


def one_server(backend, version: int = 0) -> Servers:
    """The run's servers: one, answered by the FAKE `backend`, serving weights `version`."""
    return Servers(ReplicaSet([Replica(0, "http://scripted.invalid")], version=version), [backend])

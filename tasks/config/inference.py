"""The vLLM servers a run generates on (`inference`) and how new weights reach them (`sync`)."""

from __future__ import annotations

import os

from pydantic import Field, field_validator, model_validator

from grpoflow.tasks.config.choices import SyncBackend, SyncDelta, SyncTransport
from grpoflow.tasks.config.section import Section

API_KEY_ENV = "GRPOFLOW_API_KEY"


def api_key_from_env() -> str | None:
    """The servers' bearer key from the environment (a worker's, a shell's): never a parameter."""
    return os.environ.get(API_KEY_ENV) or None


class InferenceConfig(Section):
    url: str | None = Field(None, description="vLLM server URL; None starts an embedded server.")
    urls: list[str] = Field(
        default_factory=list,
        description="Several external vLLM servers serving the same model (not with url). Each group goes "
        "to the one with the fewest outstanding groups; a weight push goes to all of them at once; one "
        "that fails leaves the rotation until it is healthy again and serves the current weights.",
    )
    replicas: int = Field(
        1,
        ge=1,
        description="Embedded servers to start when neither url nor urls is set; each gets its own share "
        "of this machine's cores and kv_cache_gb of KV cache, and is restarted and brought to the "
        "current weights if it dies.",
    )
    api_key: str | None = Field(
        default_factory=api_key_from_env,
        exclude=True,
        description="Bearer key for the servers (required off loopback); default: $GRPOFLOW_API_KEY of the "
        "process that runs the flow (a worker's environment). A secret: never written to the store, a "
        "tracker or a flow run's parameters.",
    )
    host: str = Field("127.0.0.1", description="Embedded server bind address.")
    port: int | None = Field(None, ge=1, le=65535, description="Embedded server port (None: free port).")
    kv_cache_gb: float = Field(1.0, gt=0, description="KV cache size of the embedded CPU server (GiB).")
    max_model_len: int = Field(1024, ge=16, description="Max context length of the embedded server.")
    startup_timeout_s: float = Field(600.0, gt=0, description="Wait this long for /health.")
    request_timeout_s: float = Field(600.0, gt=0, description="Timeout of one generation request.")
    retries: int = Field(4, ge=0, description="Retries on connection errors, timeouts and 5xx.")
    extra_args: list[str] = Field(default_factory=list, description="Extra vLLM server flags.")
    max_loras: int = Field(
        4,
        ge=1,
        description="With learner.lora: adapters one batch of an embedded server may mix (the current "
        "version, stale versions still generating, other lineages' adapters); more cost memory.",
    )

    @model_validator(mode="after")
    def _one_way_to_name_servers(self) -> InferenceConfig:
        if self.url and self.urls:
            raise ValueError("inference.urls: set inference.url (one server) or inference.urls, not both")
        if self.replicas > 1 and (self.url or self.urls):
            raise ValueError("inference.replicas: embedded replicas are started only when no url/urls is set")
        dupes = sorted({u for u in self.urls if self.urls.count(u) > 1})
        if dupes:
            raise ValueError(f"inference.urls: duplicate servers {dupes}")
        return self

    def external(self) -> list[str]:
        """The external servers to generate on: urls, or [url], or none (embedded)."""
        return list(self.urls) or ([self.url] if self.url else [])


class SyncConfig(Section):
    backend: SyncBackend | None = Field(
        None,
        description="Weight push backend (tasks/push/push.py: WeightPush): 'checkpoint' writes safetensors to "
        "the store, then vLLM reloads them (reload_weights); 'lora' writes the adapter (PEFT format) and "
        "vLLM loads it as an adapter named for the version, which requests then name; 'lora_merged' "
        "writes the adapter and each server merges it into its base weights in place (paused, as for "
        "'checkpoint'): generation at the base model's speed, but a server then serves this run's "
        "policy alone (its own servers, or an external one nothing else generates on). None: 'lora' "
        "when learner.lora is set, else 'checkpoint'. Runs, server revival, evaluation, promotion and "
        "rollback all load weights through it.",
    )
    sync_every: int = Field(
        1,
        ge=1,
        description="Push weights to vLLM every N training steps: fewer pushes, samples up to N - 1 "
        "steps staler (see algorithm.max_staleness).",
    )
    keep_last: int = Field(
        2,
        ge=1,
        description="Pushed weight versions kept on disk ('lora' also keeps, for a request timeout, "
        "adapters a server may still read, and keeps at least the last 2 loaded in each server).",
    )
    reload_timeout_s: float = Field(
        300.0,
        gt=0,
        description="Seconds one weight reload into vLLM may take before the push fails (the server is "
        "resumed either way). Generous: a large model from a slow disk takes minutes.",
    )
    transport: SyncTransport = Field(
        "auto",
        description="How a version reaches each server (tasks/push/transport.py): 'path' sends the "
        "version's path, which the server reads from a disk it shares with the learner (one host, or a "
        "shared filesystem); 'network' sends its bytes over HTTP into the server's own disk (a server "
        "grpoflow starts: the run's own, `grpoflow serve`, policy-server); 'auto' asks each server "
        "whether it can read the learner's files and picks 'path' if so, else 'network'. A server that "
        "cannot take the transport chosen fails the run before its first step.",
    )
    delta: SyncDelta = Field(
        "auto",
        description="Delta pushes over the network (tasks/push/delta_push.py): 'on' sends a server only "
        "the weights' elements that changed since the version this learner last sent it, while its disk "
        "still holds that version (after a restart or a missed push too; bf16 or f16 weights: "
        "model.dtype bfloat16; float32 versions always go whole), from which the server makes the whole "
        "version and checks it against the learner's checksum; the first push to a server (also after "
        "a resume), a server that no longer holds that version, refused the delta or made other bytes "
        "gets the version whole. 'auto' does as 'on' while deltas to that server cost less time than "
        "whole versions: making and applying a delta costs CPU time that only a slow link pays back "
        "(below about 3-4 Gbit/s on a 2-core CPU: BENCHMARKS.md, 'Delta pushes over the network'); after "
        "a delta that took longer than the last whole version, the next versions go whole, and every "
        "8th tries a delta again. 'off': every version goes whole. Versions sent by path are read "
        "whole by the server either way.",
    )

    @field_validator("delta", mode="before")
    @classmethod
    def _switch_words(cls, v):
        """YAML reads a bare `on` or `off` as true or false: they mean the words written."""
        return ("on" if v else "off") if isinstance(v, bool) else v

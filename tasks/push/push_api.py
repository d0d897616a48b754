"""What every weight-push backend shares: the `WeightPush` protocol, its errors, and `Sent` (how a
version reached a server). tasks/push/push.py selects a backend and runs the pushes;
tasks/push/lora_push.py is the `lora` backend, tasks/push/transport.py how versions travel."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar, Protocol

from grpoflow.tasks.rollouts.inference_api import InferenceUnavailableError


class WeightPushError(RuntimeError):
    """A weight push failed; the message names the version and the weights path, and says whether the
    server was resumed (it always is, unless resuming itself failed)."""


class WeightPushUnavailableError(WeightPushError, InferenceUnavailableError):
    """A weight push failed because the server could not be reached (pause or resume ran out of
    retries): also an InferenceUnavailableError, so callers that restart a dead server still do."""


@dataclass(frozen=True)
class Sent:
    """How one version reached one server (tasks/push/transport.py): `transport` PATH or NETWORK, the
    version's `path` on the server's host, and for NETWORK the bytes sent, the upload's seconds and
    whether it went as a delta (tasks/push/delta_push.py)."""

    PATH: ClassVar[str] = "path"
    NETWORK: ClassVar[str] = "network"

    transport: str
    path: str
    bytes: int = 0
    seconds: float = 0.0
    delta: bool = False  # NETWORK: only what changed since the server's last version was sent


class WeightPush(Protocol):
    """How a version of the weights gets into a server (tasks/push/push.py's module doc)."""

    def save(self, write: Callable[[Path], None], version: int) -> str:
        """Publish `version`, filled by `write(directory)` (the learner's `write_weights`); its path."""
        ...

    async def load(
        self, url: str, path: str, version: int, on_loaded: Callable[[int], None] | None = None
    ) -> Sent:
        """Make the server at `url` serve `path` as `version`; `on_loaded(version)` runs once it does,
        before new requests are admitted. How the version reached it (tasks/push/transport.py)."""
        ...

    def forget(self) -> None:
        """Drop the versions retention no longer keeps (never one a server serves)."""
        ...

    def model_name(self, version: int) -> str | None:
        """The model a generation request under `version` names: None for the server's own model
        (whatever weights it holds), else the name `version` was loaded under (an adapter's)."""
        ...

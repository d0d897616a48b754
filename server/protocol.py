"""The wire protocol between grpoflow and its code inside the vLLM server: routes, query and JSON field
names, the shapes of the answers, file names, headers, worker RPC names and the environment the server
reads. The server's modules (grpoflow.server.*) and the client side (tasks/rollouts/server_control.py,
tasks/push/) both import it, so each name is written once.

Standard library only, and nothing of grpoflow: the client imports it from grpoflow's environment, the
server from vLLM's (tests/unit/test_server_package.py checks both).
"""

from __future__ import annotations

import re
from typing import TypedDict

# -- routes ---------------------------------------------------------------------------------------

# vLLM's own dev-mode routes (VLLM_SERVER_DEV_MODE=1); the lease middleware reads a pause's query.
PAUSE, RESUME, COLLECTIVE_RPC = "/pause", "/resume", "/collective_rpc"
HEALTH_PATHS = ("/health", "/ping")  # open without an API key: the health probes
PAUSE_LEASE = "/grpoflow/pause_lease"  # GET -> LeaseState
ALIAS = "/grpoflow/alias"  # POST AliasRequest -> AliasAnswer
ALIASES = "/grpoflow/aliases"  # GET -> AliasTable
UPLOADS = "/grpoflow/uploads"  # POST UploadCreate -> UploadCreated; below it: upload_route()
VERSIONS = "/grpoflow/versions"  # GET -> VersionList; DELETE VERSIONS/<name> -> VersionDeleted
PROBE = "/grpoflow/probe"  # POST ProbeRequest -> ProbeAnswer
COMMIT = "commit"  # POST UPLOADS/<id>/commit -> Committed


def upload_route(upload_id: str, rest: str = "") -> str:
    """`UPLOADS/<id>` (DELETE: abort), `UPLOADS/<id>/<file path>` (PUT a chunk, `rest` URL-quoted by
    the caller) or `UPLOADS/<id>/commit`."""
    return f"{UPLOADS}/{upload_id}" + (f"/{rest}" if rest else "")


def version_route(name: str) -> str:
    """`VERSIONS/<name>` (DELETE: remove the committed version; `name` URL-quoted by the caller)."""
    return f"{VERSIONS}/{name}"


# -- query fields ---------------------------------------------------------------------------------

PAUSE_OWNER, PAUSE_LEASE_S = "owner", "lease_s"  # POST /pause?owner=...&lease_s=...
CHUNK_OFFSET, CHUNK_CRC32 = "offset", "crc32"  # PUT UPLOADS/<id>/<file>?offset=K&crc32=<8 hex>

# -- JSON bodies and answers ----------------------------------------------------------------------


class LeaseState(TypedDict):
    owner: str | None  # who paused the server (None: not paused through the lease)
    expires_in_s: float | None  # < 0: the lease ran out, the pause is abandoned
    paused_at: float | None  # epoch seconds


class AliasRequest(TypedDict):
    name: str
    target: str | None  # None removes the alias


class AliasAnswer(AliasRequest):
    previous: str | None  # the target the name pointed at before


class AliasTable(TypedDict):
    aliases: dict[str, str]  # alias -> target
    in_flight: dict[str, int]  # target -> requests rewritten to it whose answer has not ended


class UploadFile(TypedDict):
    path: str  # relative, "/"-separated
    size: int


class _UploadCreate(TypedDict):
    name: str  # the version, e.g. "<run>/v000003"
    files: list[UploadFile]


class UploadCreate(_UploadCreate, total=False):
    recycle: str  # a committed version whose files the upload overwrites in place
    # A committed version this one is made from: a declared file `X` + DELTA_SUFFIX is a delta
    # (server/delta.py's tensors, as safetensors) applied to the base's `X`; the base's other files not
    # declared are carried over (server/delta_file.py).
    base: str
    checksums: bool  # the commit answers the checksum of every safetensors file (a full pass if needed)


class UploadCreated(TypedDict):
    upload: str  # the upload's id


class ChunkWritten(TypedDict):
    path: str
    offset: int
    written: int


class _Committed(TypedDict):
    path: str  # the version's absolute path on the server's host


class Committed(_Committed, total=False):
    # safetensors file -> server/delta.py's checksum of its tensors: those of a version made from a
    # base, or of any version whose create asked for them
    checksums: dict[str, int]


class Aborted(TypedDict):
    aborted: str
    name: str


class VersionList(TypedDict):
    root: str  # the upload dir on the server's host
    versions: list[str]


class VersionDeleted(TypedDict):
    deleted: str
    path: str


class ProbeRequest(TypedDict):
    path: str  # absolute, a file named PROBE_PREFIX + 32 hex digits


class ProbeAnswer(TypedDict):
    sha256: str | None  # None: the server's host cannot read the file
    uploads: bool  # uploads are on (UPLOAD_DIR_ENV set)


class Error(TypedDict):
    error: str  # every answer other than 200 from grpoflow's routes


def fields(shape: type) -> tuple[str, ...]:
    """The keys an answer of TypedDict `shape` must have (what a client checks it received)."""
    return tuple(sorted(shape.__required_keys__))


# -- files, headers, worker RPCs, environment -------------------------------------------------------

MANIFEST = ".grpoflow-upload.json"  # in every committed upload: what marks a dir as a version
DELTA_SUFFIX = ".delta"  # an uploaded `X.delta` is a delta of the base version's file `X`
PROBE_PREFIX = ".grpoflow-probe-"  # + 32 hex digits: the only files the probe route reads
PROBE_NAME = re.compile(re.escape(PROBE_PREFIX) + r"[0-9a-f]{32}")
AUTHORIZATION, BEARER = "Authorization", "Bearer"  # `Authorization: Bearer <key>`
# The worker extension every server grpoflow starts runs with (`--worker-extension-cls`), and the methods
# it adds to vLLM's workers, called through COLLECTIVE_RPC.
WORKER_EXTENSION = "grpoflow.server.merge.LoraMerge"
RELOAD_RPC, MERGE_LORA_RPC = "grpoflow_reload_weights", "grpoflow_merge_lora"
UPLOAD_DIR_ENV = "GRPOFLOW_UPLOAD_DIR"  # where uploaded versions go; unset: uploads are off
PLAIN_RELOAD_ENV = "GRPOFLOW_PLAIN_RELOAD"  # "0": a CPU server reloads as vLLM does, not as reload.py
UPLOAD_MAX_BYTES_ENV = "GRPOFLOW_UPLOAD_MAX_BYTES"  # the largest upload taken (default 64 GiB)
API_KEY_ENV = "VLLM_API_KEY"  # the server's key (vLLM's own variable): the auth middleware checks it
GUARD_SESSION_ENV = "GRPOFLOW_GUARD_SESSION"  # "1": the guard kills its whole session (a local Ray)
# a folder the launcher made for this server alone (its IPC sockets): the guard removes it when the
# run dies
OWNED_TMPDIR_ENV = "GRPOFLOW_OWNED_TMPDIR"

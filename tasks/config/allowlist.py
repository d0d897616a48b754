"""What a run started by a Prefect worker may import, read, write and contact.

Whoever can use the Prefect UI sets a deployment's parameters, and here those are the whole config
tree: import paths (`rewards[].fn`, `tools.tools`, `tools.environment`, `data.generator`), file paths
and server URLs. The worker's own settings, environment variables of the worker process (never flow
parameters), bound them:

    GRPOFLOW_ALLOWED_MODULES  comma-separated module names; a path's module must be one of them or
                              inside one (`grpoflow.examples` allows `grpoflow.examples.rewards`).
                              Default: grpoflow.examples (the shipped rewards and environments)
    GRPOFLOW_ALLOWED_ROOTS    directories (os.pathsep-separated) every path must resolve inside.
                              Default: the worker's working directory (the project checkout)
    GRPOFLOW_ALLOWED_SERVERS  comma-separated server URLs (scheme://host:port) a run may send
                              requests to; a Ray cluster (`scale.ray_address`) as ray://host:port.
                              Default: none (embedded servers, a local Ray only)

They apply to runs a worker started (Prefect sets PREFECT__FLOW_RUN_ID in that process) and to any
process where one of them is set. The CLI on a user's own machine keeps its full freedom otherwise.
"""

from __future__ import annotations

import os
from pathlib import Path
from urllib.parse import urlsplit

MODULES, ROOTS, SERVERS = "GRPOFLOW_ALLOWED_MODULES", "GRPOFLOW_ALLOWED_ROOTS", "GRPOFLOW_ALLOWED_SERVERS"

# vLLM flags a worker-started run may add through `inference.extra_args` (tuning only: nothing that
# binds, authenticates, loads code or reads files).
SAFE_SERVER_FLAGS = {
    "--block-size",
    "--dtype",
    "--enable-prefix-caching",
    "--no-enable-prefix-caching",
    "--enforce-eager",
    "--gpu-memory-utilization",
    "--max-num-batched-tokens",
    "--max-num-seqs",
    "--seed",
    "--swap-space",
    "--tensor-parallel-size",
    "--max-logprobs",
    "--kv-cache-dtype",
}
# Flags refused everywhere, CLI included: they would undo a safety default grpoflow sets itself.
NEVER_SERVER_FLAGS = {
    "--host",
    "--port",
    "--api-key",
    "--middleware",
    "--trust-remote-code",
    "--allowed-origins",
}


class NotAllowedError(PermissionError):
    """A config value outside what the worker's settings allow; the message names the field."""


def enforced() -> bool:
    return bool(os.environ.get("PREFECT__FLOW_RUN_ID")) or any(
        os.environ.get(k) for k in (MODULES, ROOTS, SERVERS)
    )


def _list(name: str, default: list[str], sep: str = ",") -> list[str]:
    raw = os.environ.get(name)
    return default if raw is None else [x.strip() for x in raw.split(sep) if x.strip()]


def allowed_modules() -> list[str]:
    return _list(MODULES, ["grpoflow.examples"])


def allowed_roots() -> list[Path]:
    return [Path(p).resolve() for p in _list(ROOTS, [os.getcwd()], os.pathsep)]


def allowed_servers() -> list[str]:
    return [_origin(u) for u in _list(SERVERS, [])]


def _module_allowed(module: str) -> bool:
    return any(module == m or module.startswith(m + ".") for m in allowed_modules())


def check_import_path(path: str) -> None:
    """Before anything is imported: the module is allowed and the attribute is one public name (no
    walk through other objects: `grpoflow.examples.envs:random._os.system` is `os.system`)."""
    if not enforced():
        return
    module, _, attr = path.partition(":")
    if not _module_allowed(module):
        raise NotAllowedError(f"{path!r}: module {module!r} is not in {MODULES}={allowed_modules()}")
    if "." in attr or attr.startswith("_"):
        raise NotAllowedError(
            f"{path!r}: the attribute must be one public name of the module, not {attr!r} (worker-started "
            f"runs import public names of {MODULES}={allowed_modules()} only)"
        )


def check_imported(path: str, obj: object) -> None:
    """After the import: the object is defined in an allowed module (not re-exported from elsewhere)."""
    if not enforced():
        return
    home = getattr(obj, "__module__", None) or getattr(type(obj), "__module__", "")
    if not _module_allowed(home):
        raise NotAllowedError(
            f"{path!r} resolves to an object of module {home!r}, not in {MODULES}={allowed_modules()}"
        )


def check_path(value: str | os.PathLike, field: str) -> Path:
    """`value` resolved (symlinks followed) inside an allowed root; raises naming `field` otherwise."""
    p = Path(value).resolve()
    if enforced() and not any(p == r or r in p.parents for r in allowed_roots()):
        raise NotAllowedError(
            f"{field}: {str(value)!r} is outside {ROOTS}={[str(r) for r in allowed_roots()]}"
        )
    return p


def check_server(url: str, field: str) -> None:
    if enforced() and _origin(url) not in allowed_servers():
        raise NotAllowedError(f"{field}: {url!r} is not in {SERVERS}={allowed_servers()}")


def check_server_flags(args: list[str], field: str = "inference.extra_args") -> None:
    for a in args:
        flag = a.split("=", 1)[0]
        if not flag.startswith("-"):
            continue
        if flag in NEVER_SERVER_FLAGS:
            raise NotAllowedError(
                f"{field}: {flag} is refused; grpoflow sets it itself (see inference.host/port/api_key)"
            )
        if enforced() and flag not in SAFE_SERVER_FLAGS:
            raise NotAllowedError(
                f"{field}: {flag} is not allowed in a worker-started run; allowed: {sorted(SAFE_SERVER_FLAGS)}"
            )


def _origin(url: str) -> str:
    u = urlsplit(url.strip())
    port = u.port or {"http": 80, "https": 443}.get(u.scheme, 0)
    return f"{u.scheme}://{(u.hostname or '').lower()}:{port}"

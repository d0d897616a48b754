"""The prefix-cache salt of each policy version.

A reload with `pause(mode="keep")` does not clear vLLM's prefix cache, so KV computed under the old
weights would be reused by new requests with the same prompt prefix. Generation therefore salts every
request with `cache_salt_for(version)`: the weight push draws a new salt for each version it loads
(`renew_cache_salt`), so no request after a reload can hit KV blocks computed before it.
"""

from __future__ import annotations

import secrets
import threading

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

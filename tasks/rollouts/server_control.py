"""The vLLM server's control endpoints, which weight pushes and supervisors call: pause and resume
(with grpoflow's pause lease), the prefix cache, LoRA adapters and their aliases, weight loads
through `collective_rpc`, and weight versions sent as bytes (grpoflow's upload middleware; the
whole upload is tasks/push/upload.py). Routes, fields and answer shapes are grpoflow.server.protocol's,
which the server's side imports too.

`ServerControl` is a mixin of `VLLMClient` (tasks/rollouts/inference.py): it sends through the
client's `_request` (one retry policy, the control timeout) and never through the semaphore that
bounds generation, so a pause is never queued behind the requests it holds.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any
from urllib.parse import quote

import aiohttp

from grpoflow.server import protocol as wire
from grpoflow.server.protocol import MERGE_LORA_RPC, RELOAD_RPC, fields
from grpoflow.tasks.rollouts.inference_api import (
    RETRY_STATUS,
    InferenceError,
    InferenceProtocolError,
    json_object,
    no_such_method,
)


class ServerControl:
    """Pause/resume, prefix cache, adapters, aliases and weight loads of one server (a `VLLMClient`)."""

    # What the client provides (tasks/rollouts/inference.py).
    base_url: str
    control_timeout: aiohttp.ClientTimeout
    _request: Callable[..., Awaitable[str]]

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
            params[wire.PAUSE_OWNER] = owner
        if lease_s is not None:
            params[wire.PAUSE_LEASE_S] = f"{lease_s:.3f}"
        await self._request("POST", wire.PAUSE, params=params)

    async def pause_lease(self) -> wire.LeaseState:
        """Who paused the server and for how much longer."""
        text = await self._request("GET", wire.PAUSE_LEASE)
        return json_object(text, f"GET {self.base_url}{wire.PAUSE_LEASE}", fields(wire.LeaseState))

    async def resume(self) -> None:
        await self._request("POST", wire.RESUME)

    async def reset_prefix_cache(self, *, running: bool = True) -> bool:
        """Drop the server's prefix cache, for every client. `running`: requests in flight are
        preempted and recomputed (under the weights loaded now) so none keeps KV of the old ones.
        False when vLLM could not reset it (blocks still held); the caller may retry."""
        text = await self._request(
            "POST", "/reset_prefix_cache", params={"reset_running_requests": str(running).lower()}
        )
        return bool(json_object(text, f"POST {self.base_url}/reset_prefix_cache", ("success",))["success"])

    async def is_paused(self) -> bool:
        text = await self._request("GET", "/is_paused")
        value = json_object(text, f"GET {self.base_url}/is_paused", ("is_paused",))["is_paused"]
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
        middleware in the server (grpoflow.server.alias); a server without it answers
        404 (InferenceHTTPError). The target `name` pointed at before, or None."""
        text = await self._request(
            "POST",
            wire.ALIAS,
            json_body=wire.AliasRequest(name=name, target=target),
            retry_status=RETRY_STATUS - {500},
        )
        return json_object(text, f"POST {self.base_url}{wire.ALIAS}", fields(wire.AliasAnswer))["previous"]

    async def aliases(self) -> dict[str, str]:
        """The server's alias table {name: target}."""
        return (await self._alias_state())["aliases"]

    async def alias_in_flight(self) -> dict[str, int]:
        """{target: requests sent to it through an alias whose answer has not ended yet}."""
        return (await self._alias_state())["in_flight"]

    async def _alias_state(self) -> wire.AliasTable:
        where = f"GET {self.base_url}{wire.ALIASES}"
        state = json_object(await self._request("GET", wire.ALIASES), where, fields(wire.AliasTable))
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
        a pooled connection would only reveal on the next call (a reset, not retried for a reload).

        Through grpoflow's worker extension, which keeps a tied LM head current on CPU
        (grpoflow.server.merge); a server started without it gets vLLM's own reload."""
        try:
            return await self.collective_rpc(RELOAD_RPC, {"weights_path": str(path)}, timeout_s)
        except InferenceError as e:
            if not no_such_method(e, RELOAD_RPC):
                raise
        return await self.collective_rpc("reload_weights", {"weights_path": str(path)}, timeout_s)

    async def merge_lora(self, adapter_path: str, *, timeout_s: float | None = None) -> Any:
        """Serve the base model with the PEFT adapter at `adapter_path` merged into its weights (the
        server's worker extension, grpoflow.server.merge; paused around it, as for `reload_weights`)."""
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
            wire.COLLECTIVE_RPC,
            json_body=body,
            retries=0,
            timeout=timeout,
            headers={"Connection": "close"},
        )
        if not text.strip():
            return None
        return json_object(text, f"POST {self.base_url}/collective_rpc")

    # -- weight versions sent as bytes (grpoflow.server.upload; a server without the
    # middleware, or started without an upload dir, answers these with 404) -----------------------

    async def upload_begin(
        self,
        name: str,
        files: list[dict[str, Any]],
        recycle: str | None = None,
        *,
        base: str | None = None,
        checksums: bool = False,
    ) -> str:
        """Start an upload of the version `name` ({"path", "size"} per file) into the server's upload
        dir (over the files of the committed version `recycle`, which it replaces; made from the
        committed version `base` and the deltas among the files; its commit answering the checksums of
        its weights files with `checksums`); its id. A retried create that had reached the server is
        superseded by the next one."""
        body = wire.UploadCreate(name=name, files=files)
        if recycle:
            body["recycle"] = recycle
        if base:
            body["base"] = base
        if checksums:
            body["checksums"] = True
        text = await self._request("POST", wire.UPLOADS, json_body=body, retry_status=_NOT_500)
        return json_object(text, f"POST {self.base_url}{wire.UPLOADS}", fields(wire.UploadCreated))["upload"]

    async def upload_chunk(self, upload_id: str, path: str, offset: int, data: bytes, crc32: str) -> None:
        """Write `data` at `offset` of the upload's file `path`; `crc32` (8 hex digits) is its CRC-32,
        which the server checks (a mismatch is an InferenceHTTPError 422). Idempotent: retried as it is."""
        await self._request(
            "PUT",
            wire.upload_route(upload_id, quote(path)),
            data=data,
            params={wire.CHUNK_OFFSET: str(offset), wire.CHUNK_CRC32: crc32},
            retry_status=_NOT_500,
        )

    async def upload_commit(self, upload_id: str, *, timeout_s: float) -> wire.Committed:
        """Publish the version once every byte of every file has come in a chunk that matched its
        CRC-32; its path on the server's host (and its checksums, when the create asked or named a
        base). A file not covered, or a delta that does not apply to its base, is an InferenceHTTPError
        422 naming it (the upload is gone)."""
        timeout = aiohttp.ClientTimeout(total=timeout_s, sock_connect=self.control_timeout.sock_connect)
        where = wire.upload_route(upload_id, wire.COMMIT)
        text = await self._request("POST", where, json_body={}, timeout=timeout, retry_status=_NOT_500)
        return json_object(text, f"POST {self.base_url}{where}", fields(wire.Committed))

    async def upload_abort(self, upload_id: str, *, retries: int = 1) -> None:
        """Drop an upload in progress and what it wrote."""
        await self._request("DELETE", wire.upload_route(upload_id), retries=retries, retry_status=_NOT_500)

    async def uploaded_versions(self) -> list[str]:
        """The names of the versions committed in the server's upload dir."""
        return (await self.uploaded())[1]

    async def uploaded(self) -> tuple[str, list[str]]:
        """(the server's upload dir on its host, the names of the versions committed there): a
        version `name` is `<dir>/<name>`."""
        text = await self._request("GET", wire.VERSIONS)
        out = json_object(text, f"GET {self.base_url}{wire.VERSIONS}", fields(wire.VersionList))
        return out["root"], out["versions"]

    async def probe(self, path: str) -> wire.ProbeAnswer:
        """Can the server's host read the probe file `path` (a `wire.PROBE_PREFIX` file)? Its content's
        digest (None if not) and whether uploads are on. 404 without grpoflow's upload middleware."""
        body = wire.ProbeRequest(path=path)
        text = await self._request("POST", wire.PROBE, json_body=body, retry_status=_NOT_500)
        return json_object(text, f"POST {self.base_url}{wire.PROBE}", fields(wire.ProbeAnswer))

    async def delete_uploaded_version(self, name: str) -> None:
        """Remove the committed version `name` from the server's upload dir (404 if it has none)."""
        await self._request("DELETE", wire.version_route(quote(name)), retry_status=_NOT_500)


# A 500 from the upload routes is an error of the server's disk (no space, no permission): final, so
# the caller hears it at once; connection errors, timeouts and the other retryable statuses are retried.
_NOT_500 = RETRY_STATUS - {500}

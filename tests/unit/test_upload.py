"""Weight versions sent as bytes: grpoflow's upload middleware (grpoflow.server.upload)
driven as vLLM runs it, an ASGI app wrapping the server's (here a fake that answers everything else),
called by hand or served by uvicorn to the client half (tasks/push/upload.py)."""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import json
import os
import threading
import zlib

import pytest

from grpoflow.flows.processes.launch import free_port
from grpoflow.server import upload_store
from grpoflow.server.protocol import API_KEY_ENV, UPLOAD_DIR_ENV, UPLOAD_MAX_BYTES_ENV
from tests.support import wait_for

pytestmark = pytest.mark.unit
KEY = "s3cret"


@pytest.fixture
def mod(tmp_path, monkeypatch):
    """The middleware's module, with uploads going to <tmp>/uploads."""
    from grpoflow.server import upload

    monkeypatch.setenv(UPLOAD_DIR_ENV, str(tmp_path / "uploads"))
    monkeypatch.delenv(UPLOAD_MAX_BYTES_ENV, raising=False)
    monkeypatch.delenv(API_KEY_ENV, raising=False)
    return upload


async def inner(scope, receive, send):
    """The fake vLLM: 200 "vllm" for anything that reaches it."""
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"4")]})
    await send({"type": "http.response.body", "body": b"vllm"})


def call(app, method, path, body=b"", *, query=b"", parts=None, length=None, auth=None, cut=False):
    """(status, parsed answer) of one request; `parts`: the body's chunks as receive() yields them;
    `cut`: the client goes away after them (None: nothing was answered)."""
    if isinstance(body, dict):
        body = json.dumps(body).encode()
    parts = list(parts if parts is not None else [body])
    size = sum(map(len, parts)) if length is None else length
    headers = [(b"content-length", str(size).encode())] + (
        [(b"authorization", auth.encode())] if auth else []
    )
    scope = {"type": "http", "method": method, "path": path, "headers": headers, "query_string": query}
    messages = [
        {"type": "http.request", "body": p, "more_body": cut or i + 1 < len(parts)}
        for i, p in enumerate(parts)
    ]
    sent = []

    async def receive():
        return messages.pop(0) if messages else {"type": "http.disconnect"}

    async def send(m):
        sent.append(m)

    asyncio.run(app(scope, receive, send))
    if not sent:
        return None
    out = b"".join(m.get("body", b"") for m in sent[1:])
    return sent[0]["status"], (json.loads(out) if out != b"vllm" else "vllm")


def crc(data: bytes) -> str:
    return f"{zlib.crc32(data):08x}"


def put(app, upload: str, rel: str, data: bytes, at: int = 0, *, crc32: str | None = None, **kw):
    """PUT `data` at `at` of `rel` with its CRC-32 (or `crc32`): (status, answer)."""
    query = f"offset={at}&crc32={crc32 or crc(data)}".encode()
    return call(app, "PUT", f"/grpoflow/uploads/{upload}/{rel}", data, query=query, **kw)


def create(app, name: str, sizes: dict[str, int]) -> str:
    status, out = call(app, "POST", "/grpoflow/uploads", {"name": name, "files": [
        {"path": p, "size": n} for p, n in sizes.items()]})  # fmt: skip
    assert status == 200, out
    return out["upload"]


def commit(app, upload: str):
    return call(app, "POST", f"/grpoflow/uploads/{upload}/commit", b"")


def send_version(app, name: str, files: dict[str, bytes]):
    """Create, PUT each file whole (its body in two parts), commit: the commit's (status, answer)."""
    upload = create(app, name, {p: len(b) for p, b in files.items()})
    for p, b in files.items():
        assert put(app, upload, p, b, parts=[b[:5], b[5:]])[0] == 200
    return commit(app, upload)


def listing(root) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*")) if root.exists() else []


@contextlib.contextmanager
def served(app):
    """`app` on a loopback port, served by uvicorn (what vLLM runs its API server under); its URL."""
    import uvicorn

    port = free_port("127.0.0.1")
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="error"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        wait_for(lambda: server.started, 20, "uvicorn to start")
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)


def stacked_as_served(mod):
    """The fake vLLM inside grpoflow's middlewares as flows/processes/vllm_command.py gives them to vLLM (with a
    key): Starlette's add_middleware makes each one given wrap the ones given before it."""
    from grpoflow.flows.processes.vllm_command import server_command

    cmd, _, _ = server_command("m", python="py", port=9, api_key=KEY)
    app = inner
    for spec in (cmd[i + 1] for i, a in enumerate(cmd) if a == "--middleware"):
        module, name = spec.rsplit(".", 1)
        app = getattr(importlib.import_module(module), name)(app)
    return app


def test_a_version_goes_over_http_in_chunks_and_is_committed_whole(mod, tmp_path, monkeypatch):
    from grpoflow.tasks.push.upload import upload_dir
    from grpoflow.tasks.rollouts.inference import VLLMClient

    local = tmp_path / "v000003"
    files = {"model.safetensors": os.urandom(200_003), "config.json": b'{"a": 1}',
             "tokenizer/vocab.json": b"[]", "empty.txt": b""}  # fmt: skip
    for rel, data in files.items():
        (local / rel).parent.mkdir(parents=True, exist_ok=True)
        (local / rel).write_bytes(data)
    monkeypatch.setenv("VLLM_API_KEY", KEY)
    with served(stacked_as_served(mod)) as url:
        path = asyncio.run(upload_dir(url, local, "run/v000003", chunk_bytes=65536, api_key=KEY))

        async def versions():
            async with VLLMClient(url, api_key=KEY) as c:
                return await c.uploaded_versions()

        assert asyncio.run(versions()) == ["run/v000003"]
    assert path == str(tmp_path / "uploads" / "run" / "v000003")
    for rel, data in files.items():
        assert (tmp_path / "uploads" / "run" / "v000003" / rel).read_bytes() == data
    manifest = json.loads((tmp_path / "uploads/run/v000003/.grpoflow-upload.json").read_text())
    model = files["model.safetensors"]  # four chunks of 64 KiB, three on their way at once
    assert manifest["files"]["model.safetensors"] == {"size": 200_003, "chunks": [
        [at, min(at + 65536, 200_003), crc(model[at : at + 65536])] for at in range(0, 200_003, 65536)]}  # fmt: skip
    assert manifest["files"]["empty.txt"] == {"size": 0, "chunks": []}
    assert listing(tmp_path / "uploads") == ["run", "run/v000003", *sorted(
        f"run/v000003/{p}" for p in [*files, "tokenizer", ".grpoflow-upload.json"])]  # fmt: skip


def test_a_body_is_written_in_batches_as_it_arrives(mod, tmp_path, monkeypatch):
    store = upload_store
    writes, write = [], store.write
    monkeypatch.setattr(store, "write", lambda up, rel, at, pieces, c: (writes.append((at, sum(map(len, pieces)))),
                                                                        write(up, rel, at, pieces, c))[1])  # fmt: skip
    monkeypatch.setattr(mod, "WRITE_BATCH", 4096)
    app = mod.WeightUpload(inner)
    data = os.urandom(20_000)
    _, out = call(
        app, "POST", "/grpoflow/uploads", {"name": "r/v1", "files": [{"path": "w", "size": 20_000}]}
    )
    parts = [data[i : i + 1000] for i in range(0, 20_000, 1000)]
    assert put(app, out["upload"], "w", data, parts=parts) == (
        200,
        {"path": "w", "offset": 0, "written": 20_000},
    )
    assert writes == [(0, 5000), (5000, 5000), (10000, 5000), (15000, 5000)]  # 1000-byte parts, >= 4096 held


def test_a_cut_off_upload_leaves_nothing_and_the_name_can_be_sent_again(mod, tmp_path):
    app = mod.WeightUpload(inner)
    data = os.urandom(10_000)
    _, out = call(
        app, "POST", "/grpoflow/uploads", {"name": "r/v1", "files": [{"path": "w", "size": 10_000}]}
    )
    # The client sends half of the body it announced, then goes away: nobody to answer.
    assert put(app, out["upload"], "w", data, parts=[data[:5000]], length=10_000, cut=True) is None
    assert listing(tmp_path / "uploads") == [f".incoming-{out['upload']}", f".incoming-{out['upload']}/w"]
    assert call(app, "GET", "/grpoflow/versions")[1]["versions"] == []
    assert send_version(app, "r/v1", {"w": data})[0] == 200  # the next upload of the name sweeps it
    assert listing(tmp_path / "uploads") == ["r", "r/v1", "r/v1/.grpoflow-upload.json", "r/v1/w"]
    assert (tmp_path / "uploads/r/v1/w").read_bytes() == data
    status, err = put(app, out["upload"], "w", data[:10])
    assert status == 404 and "no upload" in err["error"]


def test_a_chunk_that_fails_its_crc32_is_refused_and_the_commit_names_what_never_arrived(mod, tmp_path):
    app = mod.WeightUpload(inner)
    data = os.urandom(3000)
    upload = create(app, "r/v1", {"a.safetensors": 3000, "b.json": 2})
    assert put(app, upload, "b.json", b"{}")[0] == 200
    assert put(app, upload, "a.safetensors", data[:1000])[0] == 200
    status, err = put(app, upload, "a.safetensors", data[1000:], 1000, crc32=crc(b"other bytes"))
    assert status == 422 and "a.safetensors" in err["error"] and "bytes 1000..3000" in err["error"]
    status, err = put(app, upload, "b.json", b"{}", crc32="12345678z")
    assert status == 400 and "crc32" in err["error"]
    status, err = commit(app, upload)
    assert status == 422 and "r/v1" in err["error"] and "a.safetensors's bytes 1000..3000" in err["error"]
    assert listing(tmp_path / "uploads") == []  # the upload is over: nothing of it stays
    assert call(app, "GET", "/grpoflow/versions")[1] == {"root": str(tmp_path / "uploads"), "versions": []}


def test_chunks_go_in_any_order_and_bytes_written_over_must_be_checked_again(mod, tmp_path):
    store = upload_store
    app = mod.WeightUpload(inner)
    data, junk = os.urandom(3000), b"x" * 1000
    upload = create(app, "r/v1", {"w": 3000})
    for at in (2000, 0, 1000):
        assert put(app, upload, "w", data[at : at + 1000], at)[0] == 200
    # Bytes written over by a PUT that never ended well are checked no more, until sent again.
    assert put(app, upload, "w", junk, 1000, parts=[junk[:500]], length=1000, cut=True) is None
    status, err = commit(app, upload)
    assert status == 422 and "bytes 1000..2000" in err["error"]
    upload = create(app, "r/v1", {"w": 3000})
    for at in (0, 1000, 2000):
        assert put(app, upload, "w", data[at : at + 1000], at)[0] == 200
    assert put(app, upload, "w", junk, 500, crc32=crc(b"no"))[0] == 422
    assert put(app, upload, "w", data[:2000])[0] == 200  # one chunk over two: each byte checked again
    # Two requests writing the same bytes at once (a retry of one not ended yet): the second waits.
    f = store.begin_chunk(app.uploads[upload], "w", 2500, 3000)
    status, err = put(app, upload, "w", data[2000:], 2000)
    assert status == 503 and "being written" in err["error"]
    assert commit(app, upload)[0] == 503  # nor is a version committed while a chunk is being written
    store.end_chunk(f, 2500, 3000, None)
    assert put(app, upload, "w", data[2000:], 2000)[0] == 200
    assert commit(app, upload) == (200, {"path": str(tmp_path / "uploads/r/v1")})
    assert commit(app, upload) == (200, {"path": str(tmp_path / "uploads/r/v1")})  # a retried commit
    assert (tmp_path / "uploads/r/v1/w").read_bytes() == data
    assert send_version(app, "r/v1", {"w": b"new"})[0] == 200  # a version of the same name is replaced
    assert (tmp_path / "uploads/r/v1/w").read_bytes() == b"new" and not list(
        (tmp_path / "uploads").glob(".*")
    )


def test_names_that_could_leave_the_upload_dir_are_refused(mod, tmp_path):
    app = mod.WeightUpload(inner)
    ok = [{"path": "w", "size": 1}]
    for name in ("../x", "/abs", "a/../b", "a\\b", "a\x00b", "a//b", "", "./a", ".incoming-x", "r/.v1",
                 "/".join("a" * 9), "x" * 256, 3, None):  # fmt: skip
        status, err = call(app, "POST", "/grpoflow/uploads", {"name": name, "files": ok})
        assert status == 400 and "error" in err, name
    for files in ([{"path": "../../etc/passwd", "size": 1}], [{"path": "/etc/passwd", "size": 1}],
                  [{"path": "a/./b", "size": 1}], [{"path": "a\nb", "size": 1}],
                  [{"path": ".grpoflow-upload.json", "size": 1}], [*ok, *ok],
                  [{"path": "a", "size": 1}, {"path": "a/b", "size": 1}], [{"path": "w", "size": -1}],
                  [{"path": "w", "size": "3"}], [{"path": "w", "size": True}], [{"path": "w"}], [], "w"):  # fmt: skip
        status, err = call(app, "POST", "/grpoflow/uploads", {"name": "r/v1", "files": files})
        assert status == 400 and "error" in err, files
    assert call(app, "POST", "/grpoflow/uploads", b"not json")[0] == 400
    assert call(app, "DELETE", "/grpoflow/versions/../x")[0] == 400
    assert send_version(app, "r/v1", {"w": b"1"})[0] == 200
    (tmp_path / "uploads" / "mine").mkdir()
    for name in ("r/v1/inner", "mine", "r"):  # inside a version; a folder that is not one
        status, err = call(app, "POST", "/grpoflow/uploads", {"name": name, "files": ok})
        assert status == 409 and name in err["error"], name
    assert listing(tmp_path) == ["uploads", "uploads/mine", "uploads/r", "uploads/r/v1",
                                 "uploads/r/v1/.grpoflow-upload.json", "uploads/r/v1/w"]  # fmt: skip


def test_writes_outside_what_was_declared_are_refused(mod):
    app = mod.WeightUpload(inner)
    upload = create(app, "r/v1", {"w": 10})
    assert put(app, upload, "w", b"abcd", 8)[0] == 413  # by its Content-Length
    assert (
        put(app, upload, "w", b"abcdefghijk", parts=[b"abcdef", b"ghijk"], length=0)[0] == 413
    )  # by what came
    status, err = put(app, upload, "w", b"abc", parts=[b"abc"], length=5)
    assert status == 400 and "Content-Length" in err["error"]
    assert (
        call(app, "PUT", f"/grpoflow/uploads/{upload}/w", b"ab", query=b"offset=-1&crc32=00000000")[0] == 400
    )
    status, err = call(app, "PUT", f"/grpoflow/uploads/{upload}/w", b"ab")  # no checksum
    assert status == 400 and "crc32" in err["error"]
    assert put(app, upload, "other", b"ab")[0] == 404
    assert put(app, "feedbeef", "w", b"ab")[0] == 404
    status, err = commit(app, upload)
    assert status == 422 and "w has 3 bytes, 10 were declared" in err["error"]
    upload = create(app, "r/v1", {"w": 10})
    assert put(app, upload, "w", b"0123456789")[0] == 200
    assert call(app, "DELETE", f"/grpoflow/uploads/{upload}")[1] == {"aborted": upload, "name": "r/v1"}
    assert put(app, upload, "w", b"0123456789")[0] == 404


def test_the_total_size_limit_and_the_free_space(mod, monkeypatch):
    monkeypatch.setenv("GRPOFLOW_UPLOAD_MAX_BYTES", "1000")
    app = mod.WeightUpload(inner)
    files = [{"path": "a", "size": 600}, {"path": "b", "size": 401}]
    status, err = call(app, "POST", "/grpoflow/uploads", {"name": "r/v1", "files": files})
    assert status == 413 and "1000" in err["error"]
    files[1]["size"] = 400
    assert call(app, "POST", "/grpoflow/uploads", {"name": "r/v1", "files": files})[0] == 200
    monkeypatch.delenv("GRPOFLOW_UPLOAD_MAX_BYTES")
    files = [{"path": "a", "size": 2**62}]
    assert (
        call(mod.WeightUpload(inner), "POST", "/grpoflow/uploads", {"name": "r/v2", "files": files})[0] == 413
    )
    monkeypatch.setenv("GRPOFLOW_UPLOAD_MAX_BYTES", str(2**62))
    assert (
        call(mod.WeightUpload(inner), "POST", "/grpoflow/uploads", {"name": "r/v2", "files": files})[0] == 507
    )


def test_uploads_need_the_key_where_the_server_has_one(mod, monkeypatch):
    monkeypatch.setenv("VLLM_API_KEY", KEY)
    app = stacked_as_served(mod)
    create = {"name": "r/v1", "files": [{"path": "w", "size": 1}]}
    assert call(app, "POST", "/grpoflow/uploads", create) == (401, {"error": "Unauthorized"})
    assert call(app, "GET", "/grpoflow/versions")[0] == 401
    assert call(app, "DELETE", "/grpoflow/versions/r/v1", auth="Bearer wrong")[0] == 401
    status, out = call(app, "POST", "/grpoflow/uploads", create, auth=f"Bearer {KEY}")
    assert status == 200 and "upload" in out


def test_a_committed_version_can_be_deleted(mod, tmp_path):
    app = mod.WeightUpload(inner)
    for name in ("r/v1", "r/v2"):
        assert send_version(app, name, {"w": name.encode()})[0] == 200
    (tmp_path / "uploads" / "r" / "mine").mkdir()
    assert call(app, "GET", "/grpoflow/versions")[1]["versions"] == ["r/v1", "r/v2"]
    assert call(app, "DELETE", "/grpoflow/versions/r/v1") == (
        200, {"deleted": "r/v1", "path": str(tmp_path / "uploads/r/v1")})  # fmt: skip
    assert call(app, "GET", "/grpoflow/versions")[1]["versions"] == ["r/v2"]
    assert call(app, "DELETE", "/grpoflow/versions/r/v1")[0] == 404
    assert call(app, "DELETE", "/grpoflow/versions/r/mine")[0] == 404  # not an uploaded version
    assert listing(tmp_path / "uploads") == ["r", "r/mine", "r/v2", "r/v2/.grpoflow-upload.json", "r/v2/w"]


def test_uploads_are_off_without_an_upload_dir(mod, monkeypatch):
    monkeypatch.delenv("GRPOFLOW_UPLOAD_DIR")
    app = mod.WeightUpload(inner)
    for method, path in (("POST", "/grpoflow/uploads"), ("GET", "/grpoflow/versions"),
                         ("PUT", "/grpoflow/uploads/x/w"), ("DELETE", "/grpoflow/versions/r/v1")):  # fmt: skip
        status, err = call(app, method, path, b"{}")
        assert status == 404 and "uploads are off on this server" in err["error"], path
    assert call(app, "POST", "/v1/completions", b"{}") == (200, "vllm")  # everything else passes
    assert call(app, "GET", "/grpoflow/uploadsX") == (200, "vllm")


def version_dir(tmp_path, size: int = 150_000):
    local = tmp_path / "local"
    local.mkdir()
    (local / "config.json").write_bytes(b"{}")
    (local / "model.safetensors").write_bytes(data := os.urandom(size))
    return local, data


def test_a_failed_chunk_is_sent_again(mod, tmp_path):
    from grpoflow.tasks.push.upload import upload_dir
    from grpoflow.tasks.rollouts.inference import VLLMClient

    local, data = version_dir(tmp_path)
    puts = []
    app = mod.WeightUpload(inner)

    async def flaky(scope, receive, send):  # the second PUT fails once, as an overloaded proxy may
        if scope["type"] == "http" and scope["method"] == "PUT":
            puts.append(scope["query_string"])
            if len(puts) == 2:
                while (await receive()).get("more_body"):
                    pass
                await send({"type": "http.response.start", "status": 503, "headers": []})
                return await send({"type": "http.response.body", "body": b"busy"})
        await app(scope, receive, send)

    async def go(url):
        async with VLLMClient(url, backoff_s=0.01) as client:
            return await upload_dir(client, local, "r/v1", chunk_bytes=65536, streams=1)

    with served(flaky) as url:
        path = asyncio.run(go(url))
    # config.json in one chunk, then the model's three, its first sent twice
    offsets = [q.decode().split("&")[0] for q in puts]
    assert offsets == ["offset=0", "offset=0", "offset=0", "offset=65536", "offset=131072"]
    assert (tmp_path / "uploads/r/v1/model.safetensors").read_bytes() == data and path.endswith("/r/v1")


def test_a_failed_upload_is_aborted_and_its_error_names_the_server_and_the_file(mod, tmp_path, monkeypatch):
    from grpoflow.tasks.push.upload import WeightUploadError, WeightUploadUnavailableError, upload_dir

    local, _ = version_dir(tmp_path)
    store = upload_store
    write = store.write

    def full_disk(up, rel, at, pieces, c):
        if at > 0:
            raise OSError(28, "No space left on device")
        return write(up, rel, at, pieces, c)

    monkeypatch.setattr(store, "write", full_disk)
    with served(mod.WeightUpload(inner)) as url, pytest.raises(WeightUploadError) as e:
        asyncio.run(upload_dir(url, local, "r/v1", chunk_bytes=65536))
    assert url in str(e.value) and "at model.safetensors" in str(e.value) and "No space" in str(e.value)
    assert listing(tmp_path / "uploads") == []  # aborted: the staging dir is gone
    from grpoflow.tasks.rollouts.inference import VLLMClient

    async def nobody_there(port):
        async with VLLMClient(f"http://127.0.0.1:{port}", retries=0) as client:
            await upload_dir(client, local, "r/v1")

    port = free_port("127.0.0.1")
    with pytest.raises(WeightUploadUnavailableError, match=f"127.0.0.1:{port}"):
        asyncio.run(nobody_there(port))


def test_a_version_is_cut_into_chunks_that_keep_every_stream_busy():
    from grpoflow.tasks.push.upload import chunks

    mib = 1 << 20
    todo = chunks([("adapter_config.json", 900), ("adapter.safetensors", 19_594_269), ("empty", 0),
                   ("model.safetensors", 28 * mib)], 8 * mib, 3)  # fmt: skip
    # A small file in one chunk; a 19.6 MB adapter in three even ones of whole 64 KiB blocks, not 8+8+3.6
    # MiB; an empty file in none; a large one in 8 MiB chunks.
    assert todo == [("adapter_config.json", 0, 900), ("adapter.safetensors", 0, 6_553_600),
                    ("adapter.safetensors", 6_553_600, 6_553_600), ("adapter.safetensors", 13_107_200, 6_487_069),
                    ("model.safetensors", 0, 8 * mib), ("model.safetensors", 8 * mib, 8 * mib),
                    ("model.safetensors", 16 * mib, 8 * mib), ("model.safetensors", 24 * mib, 4 * mib)]  # fmt: skip
    for rel, size in (("a", 1), ("b", 65_537), ("c", 123_456_789)):  # the chunks tile each file
        parts = chunks([(rel, size)], 8 * mib, 3)
        assert [at for _, at, _ in parts] == [sum(n for *_, n in parts[:i]) for i in range(len(parts))]
        assert sum(n for *_, n in parts) == size and all(0 < n <= 8 * mib for *_, n in parts)

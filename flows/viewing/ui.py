"""`grpoflow ui`: the rollout explorer, a read-only web application over the store.

An aiohttp server: the JSON API below (each page's figures from storage/explore.py, the rollout pages'
from storage/explore_rollouts.py, over the same confined, read-only DuckDB views and read lock as
`grpoflow sql`), and the page itself (flows/viewing/ui_static: plain HTML, JavaScript and CSS, no build step,
nothing fetched from elsewhere). The `rollout-explorer` Prefect deployment serves it from a worker.

Safety:
- Loopback by default; any other bind address needs an API key (`--api-key`, or
  `GRPOFLOW_UI_API_KEY`), sent as `Authorization: Bearer KEY` or once as `?key=KEY` (which sets an
  HttpOnly cookie).
- On loopback, a request whose Host header names another host is refused, so a web page elsewhere
  cannot reach the explorer through DNS rebinding.
- GET and HEAD only; SQL passes storage/sql.py's read-only check; files served are the named static
  files only, never a path from the request.
- Model output is data: the page builds every piece of it as text nodes, and the Content-Security-
  Policy forbids inline and foreign scripts, so a `<script>` in a completion could not run even if a
  bug rendered it as markup.

API (query-string parameters; JSON; errors as {"error": message} with 400 or 404):
  /api/runs  /api/run?run=  /api/curves?run=  /api/status_mix?run=&split=
  /api/rollouts?run=&split=&step_min=&step_max=&reward_min=&reward_max=&status=&reward_name=
                &truncated=&tool_failed=&server=&text=&offset=&limit=   (total: null under a text search)
  /api/rollouts_count?(the same filters)
  /api/rollout?run=&split=&step=&group=&sample=   /api/group?run=&split=&step=&group=
  /api/occurrences?row_id=&split=   /api/compare?row_id=&a_run=&a_step=&b_run=&b_step=&split=
  /api/canned   /api/sql?q= | ?canned=&run=  [&format=csv]
"""

from __future__ import annotations

import asyncio
import functools
import hmac
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from aiohttp import web
from prefect import flow, get_run_logger

from grpoflow.flows.processes.launch import is_loopback
from grpoflow.storage import explore, explore_rollouts
from grpoflow.storage.ids import InvalidRunIdError, validate_run_id
from grpoflow.storage.rollouts import RolloutStore
from grpoflow.storage.sql import CANNED, QueryError, format_result, query
from grpoflow.tasks.config.allowlist import check_path

STATIC = Path(__file__).parent / "ui_static"
DEFAULT_PORT = 8300
API_KEY_ENV = "GRPOFLOW_UI_API_KEY"
COOKIE = "grpoflow_ui_key"
SQL_ROWS = 5000  # rows of a SQL answer sent to the page (CSV downloads carry every row)
SPLITS = ("train", "eval")
CSP = ("default-src 'none'; script-src 'self'; style-src 'self' 'unsafe-inline'; img-src 'self' data:; "
       "connect-src 'self'; base-uri 'none'; form-action 'self'; frame-ancestors 'none'")  # fmt: skip
_LOOPBACK_NAMES = {"localhost", "127.0.0.1", "::1", "[::1]"}
EXPLORER = web.AppKey("explorer", "Explorer")
API_KEY = web.AppKey("api_key", str)
LOOPBACK = web.AppKey("loopback", bool)


class BadRequest(ValueError):
    """A parameter the page sent is missing or malformed (the message names it)."""


# -- parameters ------------------------------------------------------------------------------------


def _param(
    q, name: str, kind: Callable[[str], Any] = str, default: Any = None, required: bool = False
) -> Any:
    raw = q.get(name, "")
    if raw == "":
        if required:
            raise BadRequest(f"{name}: missing")
        return default
    try:
        return kind(raw)
    except (TypeError, ValueError):
        raise BadRequest(f"{name}: {raw!r} is not a valid {getattr(kind, '__name__', 'value')}") from None


def _run(q, name: str = "run") -> str:
    try:
        return validate_run_id(_param(q, name, required=True))
    except InvalidRunIdError as e:
        raise BadRequest(f"{name}: {e}") from None


def _split(q) -> str:
    split = _param(q, "split", default="train")
    if split not in SPLITS:
        raise BadRequest(f"split: {split!r} is not one of {list(SPLITS)}")
    return split


def _flag(raw: str) -> bool:
    if raw.lower() in ("1", "true", "yes"):
        return True
    if raw.lower() in ("0", "false", "no"):
        return False
    raise ValueError(raw)


_flag.__name__ = "flag (1 or 0)"


def rollout_filters(q) -> dict[str, Any]:
    status = _param(q, "status")
    if status is not None and status not in explore.STATUSES:
        raise BadRequest(f"status: {status!r} is not one of {list(explore.STATUSES)}")
    return {
        "split": _split(q), "step_min": _param(q, "step_min", int), "step_max": _param(q, "step_max", int),
        "reward_min": _param(q, "reward_min", float), "reward_max": _param(q, "reward_max", float),
        "status": status, "reward_name": _param(q, "reward_name"), "truncated": _param(q, "truncated", _flag),
        "tool_failed": _param(q, "tool_failed", _flag, False), "server": _param(q, "server"),
        "text": _param(q, "text"),
    }  # fmt: skip


# -- token texts -----------------------------------------------------------------------------------


@functools.lru_cache(maxsize=4)
def _tokenizer(path: str):
    """The run's base model's tokenizer, from local files only; None when it cannot be loaded (the
    page then shows token ids)."""
    try:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(path, local_files_only=True)
    except Exception:  # a moved model dir, a missing file: ids still tell the story
        return None


def tokens_of(row: dict, base_model: str | None) -> tuple[list[dict], str | None]:
    """The completion's tokens with their texts (when the base model's tokenizer loads), behaviour
    logprobs and masks."""
    ids = row.pop("completion_ids") or []
    mask = row.pop("completion_mask") or []
    lps = row.pop("logprobs") or []
    tok = _tokenizer(str(Path(base_model).resolve())) if base_model and Path(base_model).is_dir() else None
    texts = [tok.decode([i]) for i in ids] if tok is not None else [None] * len(ids)
    toks = [
        {"id": i, "text": t, "logprob": lp, "mask": m}
        for i, t, lp, m in zip(ids, texts, lps, mask, strict=False)
    ]
    return explore._clean(toks), base_model if tok is not None else None


# -- handlers --------------------------------------------------------------------------------------


class Explorer:
    """The API's handlers over one store root; each runs its queries on a worker thread."""

    def __init__(self, root: str | Path):
        self.root = Path(root).resolve()
        self.store = RolloutStore(self.root)

    def _metas(self) -> dict[str, dict]:
        return {r: self.store.read_run_meta(r) or {} for r in self.store.runs()}

    def _meta(self, run_id: str) -> dict:
        meta = self.store.read_run_meta(run_id)
        if meta is None:
            raise explore.NotFound(f"no run {run_id!r} under {self.root}")
        return meta

    def runs(self, q) -> dict:
        metas = self._metas()
        with explore.explorer_connection(self.root) as con:
            return {"runs": explore.runs_overview(con, metas)}

    def run(self, q) -> dict:
        run_id = _run(q)
        meta = self._meta(run_id)
        with explore.explorer_connection(self.root, [run_id]) as con:
            return explore.run_detail(con, run_id, meta)

    def curves(self, q) -> dict:
        run_id = _run(q)
        with explore.explorer_connection(self.root, [run_id]) as con:
            return explore.curves(con, run_id)

    def status_mix(self, q) -> dict:
        run_id = _run(q)
        with explore.explorer_connection(self.root, [run_id]) as con:
            return explore.status_mix(con, run_id, _split(q))

    def rollouts(self, q) -> dict:
        run_id = _run(q)
        filters = rollout_filters(q)
        offset, limit = _param(q, "offset", int, 0), _param(q, "limit", int, 50)
        with explore.explorer_connection(self.root, [run_id]) as con:
            return explore_rollouts.rollout_page(con, run_id, filters, offset, limit)

    def rollouts_count(self, q) -> dict:
        run_id = _run(q)
        filters = rollout_filters(q)
        with explore.explorer_connection(self.root, [run_id]) as con:
            return {"total": explore_rollouts.rollout_count(con, run_id, filters)}

    def rollout(self, q) -> dict:
        run_id, split = _run(q), _split(q)
        step, group = _param(q, "step", int, required=True), _param(q, "group", required=True)
        sample = _param(q, "sample", int, required=True)
        meta = self.store.read_run_meta(run_id) or {}
        with explore.explorer_connection(self.root, [run_id]) as con:
            row = explore_rollouts.rollout(con, run_id, split, step, group, sample)
        row["tokens"], row["tokenizer"] = tokens_of(row, meta.get("base_model"))
        return row

    def group(self, q) -> dict:
        run_id, split = _run(q), _split(q)
        step, group = _param(q, "step", int, required=True), _param(q, "group", required=True)
        with explore.explorer_connection(self.root, [run_id]) as con:
            return explore_rollouts.group(con, run_id, split, step, group)

    def occurrences(self, q) -> dict:
        row_id = _param(q, "row_id", required=True)
        with explore.explorer_connection(self.root) as con:
            return {"row_id": row_id, "occurrences": explore_rollouts.occurrences(con, row_id, _split(q))}

    def compare(self, q) -> dict:
        row_id, split = _param(q, "row_id", required=True), _split(q)
        a_run, b_run = _run(q, "a_run"), _run(q, "b_run")
        a_step, b_step = _param(q, "a_step", int, required=True), _param(q, "b_step", int, required=True)
        with explore.explorer_connection(self.root, [a_run, b_run]) as con:
            a = explore_rollouts.group_of_row(con, a_run, a_step, row_id, split)
            b = explore_rollouts.group_of_row(con, b_run, b_step, row_id, split)
        return {"row_id": row_id, "prompt": a["prompt"], "a": a, "b": b}

    def canned(self, q) -> dict:
        return {"queries": {name: " ".join(sql.split()) for name, sql in CANNED.items()}}

    def sql(self, q) -> tuple[list[str], list[tuple]]:
        name = _param(q, "canned")
        if name is not None:
            if name not in CANNED:
                raise BadRequest(f"canned: unknown query {name!r}; choose from {sorted(CANNED)}")
            run = _param(q, "run")
            return query(self.root, CANNED[name], {"run": run})
        return query(self.root, _param(q, "q", required=True))


def _json(data: Any, status: int = 200) -> web.Response:
    return web.Response(text=json.dumps(data, default=str, allow_nan=False), status=status,
                        content_type="application/json")  # fmt: skip


def _api(method: Callable[[Any], Any]) -> Callable[[web.Request], Any]:
    async def handler(request: web.Request) -> web.StreamResponse:
        try:
            result = await asyncio.to_thread(method, request.query)
        except (BadRequest, QueryError) as e:
            return _json({"error": str(e)}, 400)
        except explore.NotFound as e:
            return _json({"error": str(e)}, 404)
        return _json(result)

    return handler


async def _sql(request: web.Request) -> web.StreamResponse:
    explorer = request.app[EXPLORER]
    try:
        cols, rows = await asyncio.to_thread(explorer.sql, request.query)
    except (BadRequest, QueryError) as e:
        return _json({"error": str(e)}, 400)
    if request.query.get("format") == "csv":
        return web.Response(text=format_result(cols, rows, "csv") + "\n", content_type="text/csv",
                            headers={"Content-Disposition": 'attachment; filename="query.csv"'})  # fmt: skip
    body = [[explore._clean(v) for v in r] for r in rows[:SQL_ROWS]]
    return _json({"columns": cols, "rows": body, "row_count": len(rows), "truncated": len(rows) > SQL_ROWS})


def _static_files() -> dict[str, Path]:
    """The page's files, by name: the only files this server ever sends."""
    return {p.name: p for p in STATIC.iterdir() if p.is_file() and p.suffix in (".html", ".js", ".css")}


_TYPES = {".html": "text/html", ".js": "text/javascript", ".css": "text/css"}


def _serve_file(path: Path) -> web.Response:
    return web.Response(body=path.read_bytes(), content_type=_TYPES[path.suffix], charset="utf-8",
                        headers={"Cache-Control": "no-cache"})  # fmt: skip


@web.middleware
async def _guard(request: web.Request, handler) -> web.StreamResponse:
    """Method, Host and API key checks before any handler."""
    app = request.app
    if request.method not in ("GET", "HEAD"):
        return web.Response(status=405, text="the explorer is read-only")
    if app[LOOPBACK] and request.host.rsplit(":", 1)[0] not in _LOOPBACK_NAMES:
        return web.Response(status=403, text="this explorer answers requests for localhost only")
    key = app[API_KEY]
    if key is not None:
        given = request.query.get("key")
        if given is not None and hmac.compare_digest(given, key):
            query = {k: v for k, v in request.query.items() if k != "key"}
            resp = web.HTTPFound(request.rel_url.with_query(query))
            resp.set_cookie(COOKIE, key, httponly=True, samesite="Strict")
            raise resp
        auth = request.headers.get("Authorization", "")
        sent = auth[7:] if auth.startswith("Bearer ") else request.cookies.get(COOKIE, "")
        if not hmac.compare_digest(sent, key):
            return web.Response(status=401, text="an API key is required: add ?key=KEY to the address")
    return await handler(request)


async def _headers(request: web.Request, resp: web.StreamResponse) -> None:
    """On every answer, refusals and errors included: only the page's own script may run."""
    resp.headers.setdefault("Content-Security-Policy", CSP)
    resp.headers.setdefault("X-Content-Type-Options", "nosniff")
    resp.headers.setdefault("Referrer-Policy", "no-referrer")


def make_app(root: str | Path, *, api_key: str | None = None, loopback: bool = True) -> web.Application:
    if not Path(root).is_dir():
        raise FileNotFoundError(f"root: {str(root)!r} is not a directory (a store written by grpoflow train)")
    app = web.Application(middlewares=[_guard])
    app.on_response_prepare.append(_headers)
    app[EXPLORER] = explorer = Explorer(root)
    app[API_KEY] = api_key
    app[LOOPBACK] = loopback
    files = _static_files()
    index = files["index.html"]

    async def page(request: web.Request) -> web.StreamResponse:
        return _serve_file(index)

    async def static(request: web.Request) -> web.StreamResponse:
        path = files.get(request.match_info["name"])
        if path is None:
            raise web.HTTPNotFound()
        return _serve_file(path)

    app.router.add_get("/", page)
    app.router.add_get("/static/{name}", static)
    for name in ("runs", "run", "curves", "status_mix", "rollouts", "rollouts_count", "rollout", "group", "occurrences",
                 "compare", "canned"):  # fmt: skip
        app.router.add_get(f"/api/{name}", _api(getattr(explorer, name)))
    app.router.add_get("/api/sql", _sql)
    return app


def check_bind(host: str, api_key: str | None) -> None:
    if not is_loopback(host) and not api_key:
        raise ValueError(
            f"host: binding the explorer to {host!r} (beyond loopback) needs an API key: pass --api-key "
            f"or set {API_KEY_ENV}"
        )


async def serve(root: str | Path, host: str = "127.0.0.1", port: int = DEFAULT_PORT, api_key: str | None = None,
                ready: Callable[[str], None] | None = None) -> None:  # fmt: skip
    """Serve the explorer until cancelled."""
    api_key = api_key or os.environ.get(API_KEY_ENV) or None
    check_bind(host, api_key)
    runner = web.AppRunner(make_app(root, api_key=api_key, loopback=is_loopback(host)), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    try:
        bound = runner.addresses[0]
        url = f"http://{'localhost' if is_loopback(host) else host}:{bound[1]}/"
        (ready or print)(url)
        await asyncio.Event().wait()
    finally:
        await runner.cleanup()


@flow(name="rollout-explorer", log_prints=True)
async def rollout_explorer(root: str = "runs", host: str = "127.0.0.1", port: int = DEFAULT_PORT) -> None:
    """Serve the rollout explorer over the store at `root` until the flow run is cancelled. Beyond
    loopback, the worker's GRPOFLOW_UI_API_KEY is the key browsers must send."""
    check_path(root, "root")
    await serve(root, host, port, ready=lambda url: get_run_logger().info("rollout explorer at %s", url))

"""`grpoflow ui`: the rollout explorer, a read-only web application over the store.

An aiohttp server: the JSON API (flows/viewing/ui_api.py: each page's figures from storage/explore.py, the
rollout pages' from storage/explore_rollouts.py, over the same confined, read-only DuckDB views and
read lock as `grpoflow sql`), and the page itself (flows/viewing/ui_static: plain HTML, JavaScript and CSS, no build step,
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
"""

from __future__ import annotations

import asyncio
import hmac
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from aiohttp import web
from prefect import flow, get_run_logger

from grpoflow.flows.processes.launch import is_loopback
from grpoflow.flows.viewing.ui_api import BadRequest, Explorer
from grpoflow.storage import explore
from grpoflow.storage.sql import QueryError, format_result
from grpoflow.tasks.config.allowlist import check_path

STATIC = Path(__file__).parent / "ui_static"
DEFAULT_PORT = 8300
API_KEY_ENV = "GRPOFLOW_UI_API_KEY"
COOKIE = "grpoflow_ui_key"
SQL_ROWS = 5000  # rows of a SQL answer sent to the page (CSV downloads carry every row)
CSP = (
    "default-src 'none'; script-src 'self'; style-src 'self' 'unsafe-inline'; img-src 'self' data:; "
    "connect-src 'self'; base-uri 'none'; form-action 'self'; frame-ancestors 'none'"
)
_LOOPBACK_NAMES = {"localhost", "127.0.0.1", "::1", "[::1]"}
EXPLORER = web.AppKey("explorer", "Explorer")
API_KEY = web.AppKey("api_key", str)
LOOPBACK = web.AppKey("loopback", bool)


def _json(data: Any, status: int = 200) -> web.Response:
    return web.Response(
        text=json.dumps(data, default=str, allow_nan=False), status=status, content_type="application/json"
    )


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
        return web.Response(
            text=format_result(cols, rows, "csv") + "\n",
            content_type="text/csv",
            headers={"Content-Disposition": 'attachment; filename="query.csv"'},
        )
    body = [[explore._clean(v) for v in r] for r in rows[:SQL_ROWS]]
    return _json({"columns": cols, "rows": body, "row_count": len(rows), "truncated": len(rows) > SQL_ROWS})


def _static_files() -> dict[str, Path]:
    """The page's files, by name: the only files this server ever sends."""
    return {p.name: p for p in STATIC.iterdir() if p.is_file() and p.suffix in (".html", ".js", ".css")}


_TYPES = {".html": "text/html", ".js": "text/javascript", ".css": "text/css"}


def _serve_file(path: Path) -> web.Response:
    return web.Response(
        body=path.read_bytes(),
        content_type=_TYPES[path.suffix],
        charset="utf-8",
        headers={"Cache-Control": "no-cache"},
    )


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
    for name in ("runs", "run", "curves", "status_mix", "rollouts", "rollouts_count", "rollout", "group",
                 "occurrences", "compare", "canned"):  # fmt: skip  # a word list: the API's endpoints
        app.router.add_get(f"/api/{name}", _api(getattr(explorer, name)))
    app.router.add_get("/api/sql", _sql)
    return app


def check_bind(host: str, api_key: str | None) -> None:
    if not is_loopback(host) and not api_key:
        raise ValueError(
            f"host: binding the explorer to {host!r} (beyond loopback) needs an API key: pass --api-key "
            f"or set {API_KEY_ENV}"
        )


async def serve(
    root: str | Path,
    host: str = "127.0.0.1",
    port: int = DEFAULT_PORT,
    api_key: str | None = None,
    ready: Callable[[str], None] | None = None,
) -> None:
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

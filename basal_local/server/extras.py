"""Server pieces around the decision handlers, registered by `create_app` in a few lines.

- a read deadline for the bodies the other routes read through Litestar (`body_deadline`);
- a request id on every response (`x-request-id` and `x-typesafe-request-id`; a client's `x-request-id` is echoed);
- `GET /api/ps` (what is loaded and its memory, for `basal-local ps`), `GET /openapi.json` and `GET /docs`;
- `GET /metrics` when the daemon runs with `--metrics` (server/metrics.py).
"""

from __future__ import annotations

import asyncio
import os
import sys
import time
import uuid
from typing import Any

from litestar import Request, Response, get

from .. import __version__
from ..api.errors import dialect_of, http_error
from .body import body_timeout
from .events import cache_totals, held_totals
from .metrics import MetricsRecorder, metrics_handler
from .openapi import DOCS_HTML, openapi_document
from .responses import client_request_id, json_response
from .security import send_error
from .state import SCOPE_MODEL, AppState


def _header(scope: dict, name: bytes) -> str | None:
    for key, value in scope.get("headers", ()):
        if key.lower() == name:
            return value.decode("latin-1")
    return None


async def stamp_request_id(message: dict, scope: dict) -> None:
    """Litestar `before_send`: the request id headers on every response of the app that has none yet (the
    client's `x-request-id` echoed, else a new one), including the router's 404 and 405, which never reach a
    route's middleware. A coroutine: Litestar runs a plain function hook in a worker thread, a hop per ASGI
    message (two per response) through the thread pool and back."""
    if message["type"] != "http.response.start":
        return
    headers = message.setdefault("headers", [])
    if not any(k.lower() == b"x-request-id" for k, _ in headers):
        rid = (client_request_id(_header(scope, b"x-request-id")) or uuid.uuid4().hex).encode("latin-1")
        headers.extend([(b"x-request-id", rid), (b"x-typesafe-request-id", rid)])


def body_deadline(scope: dict, receive, send, timeout_s: float):
    """`receive` and `send` for a route that reads its body through Litestar (the decision routes read theirs with
    the same deadline: body.read_body): the whole body must arrive within `timeout_s` (an upload to /v1/files,
    up to hundreds of MB: each piece within `timeout_s` of the last), else the client is answered 408 and the
    connection closed, as the decision routes do; the route then sees the client gone."""
    upload = scope.get("path") == "/v1/files"
    deadline = time.monotonic() + timeout_s
    now: dict[str, bool] = {"reading": True, "answered": False, "started": False}

    async def receive_wrapped() -> dict:
        if not now["reading"]:
            return await receive()  # the body is in: a route waiting for the client to go (a stream) waits on
        try:
            message = await asyncio.wait_for(receive(), timeout_s if upload else max(0.0, deadline - time.monotonic()))
        except TimeoutError:
            now["reading"] = False
            if not now["started"]:
                err = body_timeout(timeout_s)
                await send_error(send, http_error(err.status, err.code, err.message, None), close=True,
                                 request_id=client_request_id(_header(scope, b"x-request-id")))
                now["answered"] = True
            return {"type": "http.disconnect"}
        if message["type"] != "http.request" or not message.get("more_body", False):
            now["reading"] = False
        return message

    async def send_wrapped(message: dict) -> None:
        if now["answered"]:
            return  # the route's answer to a client already answered 408
        if message["type"] == "http.response.start":
            now["started"] = True
        await send(message)

    return receive_wrapped, send_wrapped


def wrap_asgi(state: AppState):
    """The middleware factory for Litestar: metrics when enabled (ids: `stamp_request_id`; 529 retry slots:
    engine/gate.py `Admission`)."""
    recorder = None
    if state.metrics:
        recorder = MetricsRecorder(state)
        state.metrics_recorder = recorder  # type: ignore[attr-defined]

    def factory(app):
        async def middleware(scope, receive, send):
            if scope["type"] != "http":
                await app(scope, receive, send)
                return
            path = scope.get("path", "")
            decision = dialect_of(path) is not None  # as the router reads it (//v1/basal too)
            if not decision:
                receive, send = body_deadline(scope, receive, send, state.limits.body_timeout_s)
            started = time.perf_counter()
            seen: dict[str, Any] = {"status": 0}
            if recorder is not None and decision:
                recorder.enter(path)
            if decision and (_header(scope, b"content-encoding") or "").strip().lower() == "zstd":
                state.telemetry.count("zstd_bodies")  # typesafe-sdk compresses bodies of 1 KiB and more

            async def send_wrapped(message):
                if message["type"] == "http.response.start":
                    seen["status"] = message["status"]
                await send(message)

            try:
                await app(scope, receive, send_wrapped)
            finally:
                if recorder is not None and decision:
                    recorder.leave(path, seen["status"], time.perf_counter() - started, scope.get(SCOPE_MODEL, ""))
        return middleware
    return factory


def _rss_bytes(pid: int | None = None) -> int | None:
    """A process's resident memory (Linux /proc; for this process else the peak from resource; else unknown)."""
    try:
        with open(f"/proc/{pid or os.getpid()}/statm") as fh:
            return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, AttributeError):
        pass
    if pid not in (None, os.getpid()):
        return None
    try:
        import resource  # Unix only

        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return peak if sys.platform == "darwin" else peak * 1024
    except Exception:
        return None


def _replica(r: dict[str, Any]) -> dict[str, Any]:
    """One replica for `basal-local ps`: its process (a worker's own pid, else the daemon's), device, state, work
    and memory."""
    pid = r.get("pid") or os.getpid()
    return {"replica": r.get("replica", 0), "pid": pid, "worker_process": "pid" in r, "device": r.get("device"),
            # a dead worker process shows `restarting`/`loading` until it is back (replicas/restarts.py)
            "state": r.get("state", "ready" if r.get("alive", True) else "dead"), "alive": r.get("alive", True),
            "restarts": r.get("restarts", 0), "in_flight": r.get("requests", 0),
            # a dead worker's exit code and the wait before its restart, as /health and /api/stats show them
            **{k: r[k] for k in ("exit_code", "restart_in_s") if k in r},
            "batches": r.get("batches", 0), **(r.get("memory") or {}),
            **({"process_rss_bytes": _rss_bytes(pid)} if "pid" in r else {})}


@get("/api/ps")
async def ps(request: Request) -> Response:
    state: AppState = request.app.state.basal
    loaded = []
    states = {e["name"]: e for e in state.models.snapshot()} if state.models else {}
    for name, engine in list(state.engines.items()):
        described = engine.describe()
        # the first live replica's device, as one engine would show it
        first = next((r for r in described if r["alive"]), described[0]) if described else {}
        # the model's replicas together (the device figures are the first one's)
        memory = {**(first.get("memory") or {}), **held_totals(described)}
        devices = sorted({str(r.get("device")) for r in described if r.get("device")})
        entry = states.pop(name, {})
        loaded.append({"name": name, "path": str(engine.model.path), "version": engine.model.version,
                       "status": entry.get("status", "loaded"), "default": name == state.default_model,
                       "backend": state.backend_name, "device": ",".join(devices) or state.device,
                       "dtype": state.dtype, "aliases": sorted(a for a, t in state.aliases.items() if t == name),
                       "queue": sum(r["requests"] for r in described), **memory,
                       "prefix_cache": cache_totals(described, str(state.engine_settings.prefix_cache)),
                       "keep_alive_s": entry.get("keep_alive_s"), "expires_in_s": entry.get("expires_in_s"),
                       "replicas": [_replica(r) for r in described]})
    for entry in states.values():  # known, not loaded: loading, unloading, unloaded or failed
        loaded.append({"name": entry["name"], "path": entry["path"], "status": entry["status"],
                       "default": entry["default"], "keep_alive_s": entry["keep_alive_s"], "error": entry["error"],
                       "since": entry["since"], "replicas": []})
    return json_response(200, {"version": __version__, "ready": state.ready, "error": state.load_error,
                       "pid": os.getpid(), "process_rss_bytes": _rss_bytes(), "inflight": state.inflight,
                       "models": loaded})


@get("/openapi.json")
async def openapi(request: Request) -> Response:
    state: AppState = request.app.state.basal
    return json_response(200, openapi_document(list(state.engines) or ["basal-demo"]))


@get("/docs")
async def docs() -> Response:
    return Response(content=DOCS_HTML, status_code=200, media_type="text/html")


def extra_handlers(state: AppState) -> list:
    handlers = [ps, openapi, docs]
    if state.metrics:
        handlers.append(metrics_handler)
    return handlers

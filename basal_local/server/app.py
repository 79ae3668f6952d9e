"""The litestar app: `/v1/systemone`, `/v1/basal`, `/v1/models`, `/health`, `/api/stats`.

Handlers decode (zstd/gzip), parse, route, validate and plan in a worker thread, then wait for the
engine's future; inference never runs on the event loop. Error bodies are exactly the spec's.
"""

from __future__ import annotations

import asyncio
import gzip
import json
import logging
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from litestar import Litestar, Request, Response, get, post

from .. import __version__
from ..api import parse_body, route, validate
from ..api.errors import ApiError, internal, overloaded
from ..engine.engine import JobResult, ModelEngine
from ..engine.scheduler import Cancelled
from ..telemetry import Telemetry

log = logging.getLogger("basal_local.server")
DESCRIPTION = "basal typed-decision model (choice / noul / score / act / multi), Polish and English"
MAX_BODY_BYTES = 32 * 1024 * 1024


@dataclass
class AppState:
    """What the handlers share: engines by served name, the in-flight counter, telemetry, readiness."""

    engines: dict[str, ModelEngine] = field(default_factory=dict)
    default_model: str | None = None
    max_inflight: int = 1024
    release_date: str = "2026-10-05"
    backend_name: str = ""
    device: str = ""
    dtype: str = ""
    telemetry: Telemetry = field(default_factory=Telemetry)
    ready: bool = False
    load_error: str | None = None
    access_log: bool = False
    metrics: bool = False
    aliases: dict[str, str] = field(default_factory=dict)  # alias -> served name (server/aliases.py)
    inflight: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)
    planner: ThreadPoolExecutor = field(default_factory=lambda: ThreadPoolExecutor(4, "basal-plan"))


def _json_response(status: int, body: Any, headers: dict[str, str] | None = None) -> Response:
    content = json.dumps(body, ensure_ascii=False).encode("utf-8")
    return Response(content=content, status_code=status, media_type="application/json", headers=headers or {})


def _decode_body(raw: bytes, encoding: str | None) -> bytes:
    encoding = (encoding or "identity").strip().lower()
    if encoding in ("", "identity"):
        return raw
    if encoding == "zstd":
        import zstandard

        try:
            return zstandard.ZstdDecompressor().decompressobj().decompress(raw)
        except zstandard.ZstdError as exc:
            raise ApiError(400, {"error": f"request body is not valid zstd: {exc}", "code": "BAD_ENCODING"}) from None
    if encoding == "gzip":
        try:
            return gzip.decompress(raw)
        except OSError as exc:
            raise ApiError(400, {"error": f"request body is not valid gzip: {exc}", "code": "BAD_ENCODING"}) from None
    raise ApiError(415, {"error": f"unsupported Content-Encoding {encoding!r} (use identity, zstd or gzip)",
                         "code": "UNSUPPORTED_ENCODING"})


async def _watch_disconnect(request: Request, flag: threading.Event) -> None:
    """After the body is read, the next ASGI message is the client's disconnect."""
    try:
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                flag.set()
                return
    except Exception:
        return


async def _decide(request: Request, dialect: str) -> Response:
    state: AppState = request.app.state.basal
    arrived = time.perf_counter()
    request_id = request.headers.get("x-request-id") or uuid.uuid4().hex
    id_headers = {"x-request-id": request_id, "x-typesafe-request-id": request_id}
    admitted = False
    model_name = ""
    status = 500
    timing = ""
    try:
        if not state.ready:
            retry = {"retry-after": "5", **id_headers}
            detail = state.load_error or "the model is loading"
            raise ApiError(503, {"error": detail, "code": "LOADING"}, retry)
        body = parse_body(_decode_body(await request.body(), request.headers.get("content-encoding")), dialect)
        # order of checks (PROTOCOL.md §1.1): overload before the unknown-model error
        with state.lock:
            if state.inflight >= state.max_inflight:
                state.telemetry.count("rejected_overload")
                raise overloaded(dialect)
            state.inflight += 1
            admitted = True
        model_name = route(body, dialect, state.engines, state.default_model or "", state.aliases)
        engine = state.engines[model_name]
        loop = asyncio.get_running_loop()

        def plan():
            return engine.plan(validate(body, dialect, model_name))

        planned = await loop.run_in_executor(state.planner, plan)
        planned.arrival = arrived
        gone = threading.Event()
        watcher = asyncio.ensure_future(_watch_disconnect(request, gone))
        try:
            job = engine.submit(planned, gone.is_set, request_id)
            result: JobResult = await asyncio.wrap_future(job.future)
        finally:
            watcher.cancel()
        result.body["usage"]["latency_ms"] = round((time.perf_counter() - arrived) * 1000.0, 2)
        headers = {**id_headers, "x-basal-queue-ms": f"{result.queue_ms:.3f}",
                   "x-basal-compute-ms": f"{result.compute_ms:.3f}",
                   "x-basal-batch-requests": str(result.batch_requests)}
        state.telemetry.count("answered")
        state.telemetry.record_request(id=request_id, model=model_name, dialect=dialect,
                                       questions=len(planned.request.questions),
                                       planning_ms=round(planned.planning_s * 1000.0, 3), queue_ms=round(result.queue_ms, 3),
                                       compute_ms=round(result.compute_ms, 3), batch_id=result.batch_id,
                                       batch_requests=result.batch_requests,
                                       input_tokens=planned.input_tokens, packed_tokens=planned.packed_tokens)
        status = 200
        timing = (f" (queue {result.queue_ms:.0f} ms, compute {result.compute_ms:.0f} ms, "
                  f"batch {result.batch_requests})")
        return _json_response(200, result.body, headers)
    except ApiError as err:
        status = err.status
        if status >= 500:
            state.telemetry.count("failed")
        return _json_response(err.status, err.body, {**id_headers, **(err.headers or {})})
    except Cancelled:
        status = 499
        return _json_response(499, {"error": "client closed request"}, id_headers)
    except Exception as exc:  # a bug must not take the daemon down; the answer says what happened
        log.exception("request %s failed", request_id)
        state.telemetry.count("failed")
        err = internal(f"{type(exc).__name__}: {exc}")
        return _json_response(err.status, err.body, id_headers)
    finally:
        if admitted:
            with state.lock:
                state.inflight -= 1
        state.telemetry.count("requests")
        if state.access_log:
            log.info("[POST] %d /v1/%s %.0f ms%s", status, dialect, (time.perf_counter() - arrived) * 1e3, timing)


@post("/v1/systemone", status_code=200)
async def systemone(request: Request) -> Response:
    return await _decide(request, "systemone")


@post("/v1/basal", status_code=200)
async def basal(request: Request) -> Response:
    return await _decide(request, "basal")


@get("/v1/models")
async def models(request: Request) -> Response:
    state: AppState = request.app.state.basal
    entries = [{"name": name, "release_date": state.release_date, "description": DESCRIPTION,
                "mode": f"basal-local-{state.backend_name}-{state.device}", "early_exit": []}
               for name in state.engines]
    return _json_response(200, {"models": entries})


@get("/health")
async def health(request: Request) -> Response:
    state: AppState = request.app.state.basal
    if not state.ready:
        body: dict[str, Any] = {"status": "loading", "version": __version__}
        if state.load_error:
            body = {"status": "error", "error": state.load_error, "version": __version__}
        return _json_response(503, body)
    return _json_response(200, {"status": "ok", "version": __version__, "models": list(state.engines), "default_model": state.default_model,
                                "backend": state.backend_name, "device": state.device, "dtype": state.dtype})


@get("/api/stats")
async def stats(request: Request) -> Response:
    state: AppState = request.app.state.basal
    snap = state.telemetry.snapshot()
    snap["version"] = __version__
    snap["inflight"] = state.inflight
    snap["queues"] = {name: e.waiting() for name, e in state.engines.items()}
    snap["ready"] = state.ready
    return _json_response(200, snap)


def create_app(state: AppState) -> Litestar:
    from .extras import extra_handlers, wrap_asgi

    app = Litestar(route_handlers=[systemone, basal, models, health, stats, *extra_handlers(state)],
                   middleware=[wrap_asgi(state)], request_max_body_size=MAX_BODY_BYTES, openapi_config=None)
    app.state.basal = state
    return app

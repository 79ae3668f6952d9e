"""The litestar app: `/v1/systemone`, `/v1/basal` (+ the routes of status_routes.py, events.py, extras.py,
batch_routes.py and model_routes.py).

A decision request goes through small steps, each below: read the body (`body.py`: size limit, read
deadline, decompression in a worker thread), then in ONE hop to a planner thread: parse it, take an in-flight
slot (529 when full), route, validate and plan; then wait for the engine's future while watching for
the client's disconnect. Inference and every step whose cost grows with the body run off the event loop.
Who may call at all is decided before routing by `security.Guard`. Every error is a JSON body in the shape
of the path's dialect (`api/errors.py`).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
import traceback
import uuid
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from litestar import Litestar, Request, Response, post
from litestar.exceptions import HTTPException

from ..api import parse_body, route, validate
from ..api.answers import response_body
from ..api.errors import ApiError, dialect_of, http_error, internal, overloaded, protocol_error, refusal_error
from ..engine.gate import Entry
from ..engine.plan import RequestPlan
from ..engine.protocol import EngineUnavailable
from ..engine.scheduler import Cancelled, EngineStopped
from ..protocol.errors import AnswerRefused, ProtocolError
from ..protocol.outcome import Outcome
from ..telemetry.privacy import PRIVATE, error_summary
from .batch_routes import BATCH_ROUTES, start_batches, stop_batches
from .body import BodyError, ClientGone, read_body
from .events import EVENT_ROUTES, planned_event, request_detail
from .extras import extra_handlers, stamp_request_id, wrap_asgi
from .model_routes import MODEL_ROUTES
from .responses import client_request_id, json_response
from .state import MAX_BODY_BYTES, SCOPE_MODEL, AppState
from .status_routes import STATUS_ROUTES

log = logging.getLogger("basal_local.server")
# bodies above this are parsed and planned in their own pool, so a few big ones never delay small ones
BIG_BODY_BYTES = 256 * 1024
LOGGED_BODY_BYTES = 64 * 1024


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


@dataclass
class _Call:
    """One decision request on its way through `_decide`: what the steps hand each other and the log."""

    request: Request
    dialect: str
    state: AppState
    arrived: float = field(default_factory=time.perf_counter)
    request_id: str = ""
    model_name: str = ""
    status: int = 500
    timing: str = ""
    admission: Entry | None = None
    error: str = ""
    client_id: str = ""  # the client's X-Request-Id, echoed even when its record needed a fresh id

    @property
    def id_headers(self) -> dict[str, str]:
        reply = self.client_id or self.request_id
        return {"x-request-id": reply, "x-typesafe-request-id": reply}

    def pool(self, size: int) -> ThreadPoolExecutor:
        return self.state.big_planner if size > BIG_BODY_BYTES else self.state.planner


def _check_ready(call: _Call) -> None:
    state = call.state
    if not state.ready:
        detail = state.load_error or "the model is loading"
        raise http_error(503, "LOADING", detail, call.dialect, {"retry-after": "5"})


async def _read(call: _Call) -> bytes:
    headers = call.request.headers
    raw = await read_body(call.request.receive, headers.get("content-length"), headers.get("content-encoding"),
                          call.state.limits, call.state.big_planner)
    if call.state.log_bodies:
        log.info("request %s body: %s", call.request_id, raw[:LOGGED_BODY_BYTES].decode("utf-8", "replace"),
                 extra={PRIVATE: True})
    return raw


def _admit(call: _Call) -> Entry:
    """Take an in-flight place, or wait a bounded moment for one (engine/gate.py `Admission`); 529 with a kept
    retry slot when none comes (docs/PROTOCOL.md §1.2). `_release` gives it back."""
    retry = (call.request.headers.get("x-typesafe-retry-count") or "0").strip() not in ("", "0")
    entry = call.state.admission.enter(call.state.max_inflight, retry)
    _admitted(call, entry)
    return entry


def _admitted(call: _Call, entry: Entry) -> None:
    if entry.state == "rejected":
        raise overloaded(call.dialect, entry.headers)
    if entry.admitted:
        call.admission = entry
        call.state.inflight = call.state.admission.inflight


async def _wait_for_place(call: _Call, entry: Entry) -> None:
    try:
        await asyncio.wait_for(asyncio.wrap_future(entry.future), entry.wait_s)  # type: ignore[arg-type]
        entry.state = "admitted"
    except TimeoutError:
        entry = call.state.admission.give_up(entry, call.state.max_inflight)
    except asyncio.CancelledError:  # shutdown: a place handed over meanwhile is released by `_release`
        entry = call.state.admission.give_up(entry, call.state.max_inflight)
        if entry.admitted:
            call.admission = entry
        raise
    _admitted(call, entry)


def _release(call: _Call) -> None:
    if call.admission is not None:
        call.state.admission.leave(call.admission)
        call.state.inflight = call.state.admission.inflight
        call.admission = None


async def _parse_and_plan(call: _Call, raw: bytes, gone: threading.Event) -> tuple[RequestPlan, Future[Outcome]]:
    """Parse, take an in-flight slot, route, validate, plan and submit in ONE hop to a planner thread
    (each hop costs the event loop a wake-up and the request a thread hand-off; the request reaches its lane
    straight from the planner); the checks keep their order (docs/PROTOCOL.md §1.1: overload before the
    unknown-model error)."""
    dialect = call.dialect

    def work(body: Any = None) -> Any:
        if body is None:
            body = parse_body(raw, dialect)
            entry = _admit(call)
            if not entry.admitted:  # wait for a place on the event loop, then come back
                return body, entry
        registry = call.state.models  # known models that are not loaded route too, and start loading
        call.model_name = route(body, dialect, registry.routable() if registry else call.state.engines,
                                call.state.default_model or "", call.state.aliases)
        engine = call.state.engines.get(call.model_name)
        if engine is None:
            raise registry.not_loaded(call.model_name, dialect)
        if registry is not None:
            registry.touch(call.model_name)  # the keep-alive clock
        planned = engine.plan(validate(body, dialect, call.model_name))
        planned.arrival = call.arrived
        planned.background = call.request.headers.get("x-basal-priority") == "batch"  # the Batch API's lines
        call.state.telemetry.emit("planned", **planned_event(call.request_id, call.model_name, planned))
        return planned, engine.submit(planned, gone.is_set, call.request_id)

    loop = asyncio.get_running_loop()
    try:
        out = await loop.run_in_executor(call.pool(len(raw)), work)
        if isinstance(out[-1], Entry):
            await _wait_for_place(call, out[-1])
            out = await loop.run_in_executor(call.pool(len(raw)), work, out[0])
        return out
    except RuntimeError:
        if call.state.stopping:  # the planner pools are shut down
            raise EngineStopped() from None
        raise


async def _outcome(future: Future[Outcome]) -> Outcome:
    """Wait for the engine's Outcome (every round of the request inside; a client that disconnects meanwhile is
    dropped unanswered); a refusal is raised for the dialect's 422."""
    outcome = await asyncio.wrap_future(future)
    if outcome.refused is not None:
        raise AnswerRefused(*outcome.refused)
    return outcome


def _answer(call: _Call, planned: RequestPlan, result: Outcome) -> Response:
    body = response_body(result, call.dialect, (time.perf_counter() - call.arrived) * 1000.0)
    headers = {**call.id_headers, "x-basal-queue-ms": f"{result.queue_ms:.3f}",
               "x-basal-compute-ms": f"{result.compute_ms:.3f}",
               "x-basal-batch-requests": str(result.batch_requests),
               "x-basal-cached-tokens": str(result.cached_tokens)}
    telemetry = call.state.telemetry
    telemetry.record_request(id=call.request_id, model=call.model_name, dialect=call.dialect,
                             questions=len(planned.request.questions),
                             planning_ms=round(result.planning_ms, 3), queue_ms=round(result.queue_ms, 3),
                             compute_ms=round(result.compute_ms, 3), batch_id=result.batch_id,
                             batch_requests=result.batch_requests,
                             input_tokens=result.input_tokens, packed_tokens=result.packed_tokens,
                             cached_tokens=result.cached_tokens,
                             total_ms=body["usage"]["latency_ms"], detail=request_detail(planned, body))
    call.status = 200
    call.timing = (f" (queue {result.queue_ms:.0f} ms, compute {result.compute_ms:.0f} ms, "
                   f"batch {result.batch_requests})")
    return json_response(200, body, headers)


def _error(call: _Call, err: ApiError, close: bool = False) -> Response:
    call.status = err.status
    call.error = error_summary(err.body)  # the record keeps codes only: a message may quote the request
    headers = {**call.id_headers, **(err.headers or {})}
    if close:
        headers["connection"] = "close"
    return json_response(err.status, err.body, headers)


def _failure(call: _Call, exc: Exception) -> ApiError:
    """A failure of ours as the dialect's 500; a device out of memory as a 503 the client may retry."""
    # torch.OutOfMemoryError / torch.cuda.OutOfMemoryError, here or in a replica's process (its `type_name`)
    if getattr(exc, "type_name", type(exc).__name__) == "OutOfMemoryError":
        log.warning("request %s: the device ran out of memory in its batch", call.request_id)
        return http_error(503, "OUT_OF_MEMORY", "the device ran out of memory for this request's batch; retry "
                          "(with fewer or shorter questions), or start the daemon with a lower "
                          "--max-batch-tokens", call.dialect, {"retry-after": "1"})
    if call.state.log_bodies:
        log.exception("request %s failed", call.request_id, extra={PRIVATE: True})
    else:  # the exception's text may quote the request: the type and the frames only
        frames = "".join(traceback.format_tb(exc.__traceback__))
        log.error("request %s failed: %s (text withheld; --log-bodies shows it)\n%s", call.request_id,
                  type(exc).__name__, frames)
    return internal(f"{type(exc).__name__}: {exc}", call.dialect)


async def _decide(request: Request, dialect: str) -> Response:
    call = _Call(request, dialect, request.app.state.basal)
    # a client's id names its record only if no recent request holds it: nobody overwrites another's record
    call.client_id = client_request_id(request.headers.get("x-request-id")) or ""
    call.request_id = call.state.telemetry.request_received(call.client_id or uuid.uuid4().hex, dialect,
                                                            request.headers.get("user-agent", ""))
    try:
        _check_ready(call)
        raw = await _read(call)
        gone = threading.Event()
        watcher = asyncio.ensure_future(_watch_disconnect(call.request, gone))
        try:
            planned, future = await _parse_and_plan(call, raw, gone)
            result = await _outcome(future)
        finally:
            watcher.cancel()
        return _answer(call, planned, result)
    except ApiError as err:
        return _error(call, err)
    except ProtocolError as exc:
        return _error(call, protocol_error(exc, dialect))
    except AnswerRefused as exc:
        return _error(call, refusal_error(exc, dialect))
    except BodyError as exc:
        return _error(call, http_error(exc.status, exc.code, exc.message, dialect), close=exc.close)
    except (ClientGone, Cancelled) as exc:
        call.status = 499
        where = "mid-body" if isinstance(exc, ClientGone) else "before its answer"
        log.info("request %s: client disconnected %s (cancelled)", call.request_id, where)
        return json_response(499, {"error": "client closed request"}, call.id_headers)
    except EngineStopped:
        registry = call.state.models
        if registry is not None and not call.state.stopping and call.model_name in registry.entries \
                and call.model_name not in call.state.engines:  # unloaded while this request was planned: retry
            return _error(call, registry.not_loaded(call.model_name, dialect))
        return _error(call, internal("engine stopped", dialect))
    except EngineUnavailable as exc:
        log.warning("request %s: %s (answered 503)", call.request_id, exc)
        return _error(call, http_error(503, "UNAVAILABLE", f"{exc}; retry in {exc.retry_after_s} s", dialect,
                                       {"retry-after": str(exc.retry_after_s)}))
    except asyncio.CancelledError:  # the server cancelled the handler (shutdown): counted as cancelled
        call.status = 499
        raise
    except Exception as exc:  # a bug must not take the daemon down; the answer says what happened
        return _error(call, _failure(call, exc))
    finally:
        _release(call)
        if call.model_name in call.state.engines:  # /metrics counts every answer of a served model under its name
            request.scope[SCOPE_MODEL] = call.model_name  # type: ignore[literal-required]
        call.state.telemetry.request_finished(call.request_id, call.status, call.error)
        if call.state.access_log:
            log.info("[POST] %d /v1/%s %.0f ms%s", call.status, dialect,
                     (time.perf_counter() - call.arrived) * 1e3, call.timing)


@post("/v1/systemone", status_code=200)
async def systemone(request: Request) -> Response:
    return await _decide(request, "systemone")


@post("/v1/basal", status_code=200)
async def basal(request: Request) -> Response:
    return await _decide(request, "basal")


def _http_exception(request: Request, exc: Exception) -> Response:
    """404, 405 and any other framework error in the path's dialect shape (never litestar's own)."""
    dialect = dialect_of(request.url.path)
    if isinstance(exc, HTTPException):
        status = exc.status_code
        message = {404: f"no such endpoint: {request.method} {request.url.path}",
                   405: f"method {request.method} is not allowed on {request.url.path}"}.get(status, exc.detail)
        err = http_error(status, {404: "NOT_FOUND", 405: "METHOD_NOT_ALLOWED"}.get(status, "HTTP_ERROR"), message,
                         dialect, dict(exc.headers or {}))
    else:
        log.error("unhandled %s on %s", type(exc).__name__, request.url.path)
        err = internal(type(exc).__name__, dialect)
    return json_response(err.status, err.body, err.headers)


def create_app(state: AppState) -> Litestar:
    app = Litestar(route_handlers=[systemone, basal, *STATUS_ROUTES, *EVENT_ROUTES, *extra_handlers(state),
                                   *BATCH_ROUTES, *MODEL_ROUTES],
                   middleware=[wrap_asgi(state)], request_max_body_size=MAX_BODY_BYTES, openapi_config=None,
                   exception_handlers={Exception: _http_exception}, before_send=[stamp_request_id],
                   on_startup=[start_batches], on_shutdown=[stop_batches],
                   logging_config=None)  # litestar's would replace the root handlers: the log file, -v
    app.state.basal = state
    return app

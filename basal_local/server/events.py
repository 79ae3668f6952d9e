"""Routes for dashboards: `GET /api/events` (server-sent events), `GET /api/requests/{id}`, the stats snapshot.

`/api/events` sends one JSON object per event (`data:` line, the sequence number as `id:`). A client that
reconnects with `Last-Event-ID` (or `?since=N`) first gets the events after N still in the bounded history.
A reader that falls behind gets `{"kind": "dropped", "count": n}` in place of what it lost, and should
re-read `/api/stats`. Nothing here waits on the engine: the bus hands events over without blocking.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

import msgspec
from litestar import Request, Response, get
from litestar.response import Stream

from .. import __version__
from ..model.formats import port_summary
from ..telemetry import DETAIL_KEYS, Lazy, resolve
from ..telemetry.privacy import PRIVATE, privileged
from .state import MAX_BODY_BYTES, AppState

KEEPALIVE_S = 15.0
# Events go out in bundles: after a send, the stream waits this long before it drains again, so a busy daemon
# wakes its event loop and writes to the socket ~10 times a second per dashboard instead of once per event
# (on the H200, 4.5B, 32 clients, an SSE listener served one send per event cost the daemon ~4 % of its req/s
# and ~20 % of its p99; docs/PERFORMANCE.md). The first event after a quiet spell still goes out at once; a
# dashboard redraws at 4 Hz anyway.
FLUSH_S = 0.1
# msgspec encodes the events (a batch tree is hundreds of nested dicts) several times faster than json.dumps,
# on the daemon's event loop where every millisecond is an HTTP request waiting; a Lazy tree is built here.
_ENCODER = msgspec.json.Encoder(enc_hook=resolve)
WITHHELD = ("questions and answers are shown only to the daemon's dashboards (their token) or with the API key "
            "(SECURITY.md)")
MAX_TEXT = 300  # instructions and option texts kept for the detail view are cut to this many characters


def _cut(text: Any) -> str:
    text = str(text)
    return text if len(text) <= MAX_TEXT else text[: MAX_TEXT - 1] + "\u2026"


def planned_event(request_id: str, model: str, planned: Any) -> dict[str, Any]:
    """Fields of the `planned` event from a RequestPlan."""
    return {"id": request_id, "model": model, "questions": len(planned.request.questions),
            "input_tokens": planned.input_tokens, "packed_tokens": planned.packed_tokens,
            "planning_ms": round(planned.planning_s * 1000.0, 3)}


def request_detail(planned: Any, body: dict[str, Any]) -> Lazy:
    """Questions (type, instructions, options) and answers of a request, for the detail view. No state text.

    Built when `/api/requests/{id}` reads it; until then it holds the parsed questions and the answers only."""
    asked, answers = planned.request.questions, body.get("answers", {})

    def build() -> dict[str, Any]:
        questions = [{"id": q.qid, "type": q.qtype, "instructions": _cut(q.instructions_text),
                      "options": [[k, _cut(t)] for k, t in zip(q.keys, q.options)]} for q in asked]
        return {"asked": questions, "answers": answers}

    return Lazy(build)


# what an engine's `describe` gives the server itself, beyond what /health and /api/stats list per replica
SERVER_ONLY = ("requests", "lanes", "memory")


def _queues(state: AppState, described: dict[str, tuple[Any, list[dict[str, Any]]]]) -> dict[str, dict[str, Any]]:
    running = state.telemetry.running
    out: dict[str, dict[str, Any]] = {}
    for name, (_, replicas) in described.items():
        lanes = {}
        for replica in replicas:
            # several replicas of a model (--devices/--replicas): one entry per replica's lane ("main-r1")
            for label, lane in replica["lanes"].items():
                lanes[label] = {**lane, "running": dict(running.get(f"{name}/{label}") or {})}
        out[name] = lanes
    return out


def _models(state: AppState, described: dict[str, tuple[Any, list[dict[str, Any]]]]) -> list[dict[str, Any]]:
    out = []
    for name, (engine, replicas) in described.items():
        cfg = engine.model.config
        s = state.engine_settings
        out.append({"name": name, "path": str(engine.model.path), "version": engine.model.version,
                    "layers": cfg.num_hidden_layers, "hidden_size": cfg.hidden_size, "vocab_size": cfg.vocab_size,
                    "max_positions": cfg.max_position_embeddings, "default": name == state.default_model,
                    "calibration": {"present": engine.model.calibration.present,
                                    "temperatures": engine.model.calibration.temperatures,
                                    "thresholds": engine.model.calibration.thresholds},
                    "port": port_summary(engine.model),
                    "prefix_cache": cache_totals(replicas, str(s.prefix_cache)),
                    "engine": {"max_batch_tokens": s.max_batch_tokens, "schedule": s.schedule,
                               "long_tokens": s.long_tokens, "long_slice_ms": s.long_slice_ms,
                               "max_row_tokens": s.max_row_tokens, "max_forward_tokens": s.max_forward_tokens,
                               "prefix_cache": s.prefix_cache},
                    "replicas": [_replica(r) for r in replicas]})
    return out


def _replica(described: dict[str, Any]) -> dict[str, Any]:
    """One replica of a model as the dashboard shows it: its device, its memory, its state cache (when it has
    one). The lanes are in `queues`."""
    out = {k: described[k] for k in ("replica", "device", "alive", "state", "restarts") if k in described}
    out["memory"] = dict(described.get("memory") or {})
    if isinstance(described.get("prefix_cache"), dict):
        out["prefix_cache"] = described["prefix_cache"]
    return out


CACHE_SUMS = ("budget_bytes", "bytes", "peak_bytes", "nodes", "pinned", "tokens", "capacity_tokens", "hits", "misses",
              "hit_tokens", "evictions")


def cache_totals(replicas: list[dict[str, Any]], setting: str) -> dict[str, Any]:
    """A model's state cache over its replicas (each replica's own is in its describe entry)."""
    caches = [r["prefix_cache"] for r in replicas if r.get("prefix_cache")]
    out: dict[str, Any] = {"enabled": any(c.get("enabled") for c in caches), "setting": setting}
    for key in CACHE_SUMS:
        out[key] = sum(int(c.get(key, 0)) for c in caches)
    return out


def stats_snapshot(state: AppState) -> dict[str, Any]:
    """Everything a dashboard needs at start: identity, limits, counters, percentiles, queues, recent history."""
    state.telemetry.device.cuda = str(state.device or "").startswith("cuda")  # replicas may run in workers
    snap = state.telemetry.snapshot()
    # each engine described once per snapshot (its backend's memory, its cache's counters): models and queues read it
    described = {name: (engine, engine.describe()) for name, engine in list(state.engines.items())}
    snap.update({"version": __version__, "ready": state.ready, "load_error": state.load_error,
                 "backend": state.backend_name, "device": state.device, "dtype": state.dtype,
                 "torch_options": state.torch_options, "models": _models(state, described), "default_model": state.default_model,
                 "limits": {"max_inflight": state.max_inflight, "max_body_bytes": MAX_BODY_BYTES},
                 "inflight": state.inflight, "queues": _queues(state, described),
                 "subscribers": state.telemetry.bus.subscribers})
    snap.setdefault("memory", {}).update(held_totals([r for _, rs in described.values() for r in rs]))
    return snap


# memory each replica holds apart (its weights, its state cache's pool, its CUDA graphs): the daemon's figure is
# their sum over every model and replica, not one replica's; the device figures stay the device's own
ADDITIVE_MEMORY = ("weights_bytes", "prefix_cache_bytes", "graphs_bytes")


def held_totals(replicas: list[dict[str, Any]]) -> dict[str, int]:
    """ADDITIVE_MEMORY summed over `replicas` (describe entries), a worker process that is gone left out (its last
    report stays in `describe`; a dead in-process replica still holds its memory)."""
    memories = [r.get("memory") or {} for r in replicas if not ("pid" in r and not r.get("alive", True))]
    return {key: sum(int(m.get(key, 0)) for m in memories) for key in ADDITIVE_MEMORY
            if any(key in m for m in memories)}


def _sse(event: dict[str, Any]) -> bytes:
    data = _ENCODER.encode(event)  # a Lazy tree: built now
    seq = event.get("seq")
    return (b"id: %d\n" % seq if seq else b"") + b"data: " + data + b"\n\n"


async def _stream(state: AppState, since: int | None, private: bool = False) -> AsyncIterator[bytes]:
    loop = asyncio.get_running_loop()
    wake = asyncio.Event()
    sub = state.telemetry.bus.subscribe(since=since)
    sub.waker = lambda: loop.call_soon_threadsafe(wake.set)
    state.event_streams.add(sub.waker)
    try:
        yield b": basal-local events\n\n"
        while not state.closing:
            items, dropped = sub.drain()
            if not private:  # logged request bodies (--log-bodies) only for the dashboard token or the key
                items = [e for e in items if not e.get(PRIVATE)]
            if items or dropped:
                lost = [{"kind": "dropped", "count": dropped, "ts": round(time.time(), 6)}] if dropped else []
                yield b"".join(_sse(e) for e in lost + items)
                await asyncio.sleep(FLUSH_S)  # let the next events gather into one bundle
                continue  # events that came while we sent or slept are drained before we wait
            # nothing between the empty drain and this clear can run: the next event's wake-up comes after it
            wake.clear()
            try:
                await asyncio.wait_for(wake.wait(), KEEPALIVE_S)
            except TimeoutError:
                yield b": keepalive\n\n"
    finally:
        state.event_streams.discard(sub.waker)
        sub.close()


def close_streams(state: AppState) -> None:
    """Shutdown began: every open event stream ends its response now, so the drain waits for no dashboard."""
    state.closing = True
    for wake in list(state.event_streams):
        wake()


@get("/api/events")
async def events(request: Request) -> Stream:
    state: AppState = request.app.state.basal
    since: int | None = None
    raw = request.query_params.get("since") or request.headers.get("last-event-id")
    if raw:
        try:
            since = int(raw)
        except ValueError:
            since = None
    private = privileged(request.headers, state.dashboard_token, state.api_key_set)
    return Stream(_stream(state, since, private), media_type="text/event-stream",
                  headers={"cache-control": "no-cache", "x-accel-buffering": "no"})


@get("/api/requests/{request_id:str}")
async def request_record(request: Request) -> Response:
    state: AppState = request.app.state.basal
    request_id = request.path_params["request_id"]
    record = state.telemetry.request(request_id)
    if record is None:
        return Response(content={"error": f"no request {request_id[:128]!r} in the recent history",
                                 "code": "NOT_FOUND"}, status_code=404)
    if not privileged(request.headers, state.dashboard_token, state.api_key_set):
        record = {k: v for k, v in record.items() if k not in DETAIL_KEYS}
        record["withheld"] = WITHHELD
    return Response(content=record, status_code=200)


EVENT_ROUTES = [events, request_record]


class BusLogHandler(logging.Handler):
    """Log records as `log` events, so a dashboard's log pane shows the daemon's log (never the state text)."""

    def __init__(self, state: AppState, level: int = logging.INFO) -> None:
        super().__init__(level)
        self.state = state

    def emit(self, record: logging.LogRecord) -> None:
        try:
            message = record.getMessage()
            if record.exc_info and record.exc_info[1] is not None:
                message += f" ({type(record.exc_info[1]).__name__}: {record.exc_info[1]})"
            private = {PRIVATE: True} if getattr(record, PRIVATE, False) else {}
            self.state.telemetry.emit("log", level=record.levelname, logger=record.name, message=message[:1000],
                                      **private)
        except Exception:  # logging must never raise into the caller
            self.handleError(record)

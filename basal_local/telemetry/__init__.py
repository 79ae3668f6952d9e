"""Engine and server events kept in bounded history, for `/api/stats`, `/api/events`, the headers and the dashboard.

Request counters add up at every instant (one lock): received = answered + failed + rejected (4xx) +
overloaded (529) + cancelled (499) + in_flight. Events go through `EventBus` (bus.py), which never blocks.

What only a dashboard reads (a batch's tree, a request's questions and answers) is recorded as `Lazy`: the
engine hands over a builder, and the JSON is built when someone reads it (an `/api/events` subscriber, the
`/api/stats` snapshot, `/api/requests/{id}`). With nobody listening, no tree is ever built.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from .bus import Event, EventBus, Subscription
from .device import DeviceMonitor
from .privacy import PRIVATE

__all__ = ["KEEP_UNBUILT", "BatchRecord", "Event", "EventBus", "Lazy", "Subscription", "Telemetry", "outcome_of",
           "percentile", "resolve"]

log = logging.getLogger(__name__)

OUTCOMES = ("answered", "failed", "rejected", "overloaded", "cancelled")
DETAIL_KEYS = ("asked", "answers", "detail")  # kept for GET /api/requests/{id}, left out of lists and events
MEMORY_EVERY_S = 1.0  # device memory is sampled at most this often on the batch path
KEEP_UNBUILT = 64  # batches whose tree can still be built; older unread ones let their tries go (memory)
LOG_BACKLOG = 200  # log events the snapshot carries, so a dashboard that attaches late still sees the start-up


class Lazy:
    """A JSON value built on first read, once; `forget()` drops an unbuilt builder (its value reads as None).

    Two threads reading at once may both build it (the same value; the first kept is as good as the second):
    cheaper than a lock on a path that almost never races."""

    __slots__ = ("_build", "_value", "_built", "_on_build")

    def __init__(self, build: Callable[[], Any], on_build: Callable[[], None] | None = None) -> None:
        self._build: Callable[[], Any] | None = build
        self._value: Any = None
        self._built = False
        self._on_build = on_build

    @property
    def built(self) -> bool:
        return self._built

    def value(self) -> Any:
        if not self._built:
            build = self._build
            if build is None:  # forgotten before anyone read it
                return None
            try:
                self._value = build()
            except Exception:  # a reader (an event stream, /api/stats) must never break on a dashboard detail
                log.exception("building a dashboard record failed; it reads as null")
                self._value = None
            self._built, self._build = True, None
            if self._on_build is not None:
                self._on_build()
        return self._value

    def forget(self) -> None:
        if not self._built:
            self._build = None


def resolve(value: Any) -> Any:
    """`json.dumps(default=resolve)`: a Lazy becomes its value; anything else is not JSON."""
    if isinstance(value, Lazy):
        return value.value()
    raise TypeError(f"{type(value).__name__} is not JSON serializable")


@dataclass
class BatchRecord:
    batch_id: int
    model: str
    lane: str
    requests: int
    questions: int
    prompts: int
    forwards: int
    packed_tokens: int
    unpacked_tokens: int
    compute_ms: float
    started: float
    tree: list[dict[str, Any]] | Lazy | None = field(default_factory=list)  # Lazy from the engine: built on read
    replica: int = 0
    device: str = ""
    request_ids: list[str] = field(default_factory=list)
    memory: dict[str, int] = field(default_factory=dict)
    forward: str = ""  # how its forwards ran (a launch handle's `kind`: eager, graph, graph captured now)
    device_ms: float | None = None  # the device's own time for them, where the backend times it (CUDA graphs)


def _fields(record: BatchRecord, build: bool = False) -> dict[str, Any]:
    """A shallow dict of a record: the tree is shared, never copied (dataclasses.asdict deep-copies it; nobody
    mutates a tree once recorded). With `build`, a Lazy tree is built (the snapshot); else it stays Lazy."""
    fields = dict(record.__dict__)
    if build and isinstance(fields["tree"], Lazy):
        fields["tree"] = fields["tree"].value()
    return fields


def outcome_of(status: int) -> str:
    """The counter a finished request adds to, by its HTTP status."""
    if status < 400:
        return "answered"
    if status == 499:
        return "cancelled"
    if status == 529:
        return "overloaded"
    if status < 500:
        return "rejected"
    return "failed"


def percentile(values: list[float], q: float) -> float | None:
    """Nearest-rank percentile (q in 0..100); None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    rank = max(1, -(-len(ordered) * q // 100))  # ceil(n * q / 100), at least 1
    return ordered[int(min(rank, len(ordered))) - 1]


def host_memory() -> dict[str, int]:
    """Resident memory of this process (Linux /proc; elsewhere the peak from getrusage)."""
    try:
        with open("/proc/self/statm") as fh:
            return {"host_rss_bytes": int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")}
    except (OSError, ValueError, IndexError):
        try:
            import resource

            peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
            return {"host_peak_rss_bytes": peak if os.uname().sysname == "Darwin" else peak * 1024}
        except Exception:
            return {}


class Telemetry:
    def __init__(self, history: int = 256, events: int = 2048) -> None:
        self._lock = threading.Lock()
        self.bus = EventBus(events)
        self.batches: deque[BatchRecord] = deque(maxlen=history)
        self.requests: deque[dict[str, Any]] = deque(maxlen=history)
        self._by_id: dict[str, dict[str, Any]] = {}
        self._pending: dict[str, dict[str, Any]] = {}  # in flight, by request id
        # engine counters (the engine's "cancelled" = jobs dropped from a queue before compute)
        self.counters: dict[str, int] = {"cancelled": 0, "forwards": 0, "batches": 0}
        self.totals: dict[str, int] = {"received": 0, **{k: 0 for k in OUTCOMES}, "in_flight": 0}
        self.running: dict[str, dict[str, Any]] = {}  # "model/lane" -> the batch it computes now
        self.started = time.time()
        self._batch_ids = 0
        self.memory_probe: Callable[[], dict[str, int]] | None = None
        self._memory: dict[str, int] = {}
        self._memory_at = 0.0
        self._listeners: list[Callable[[str, Any], None]] = []
        self.trees_built = 0  # batch trees built (they are only when read: tests, the A/B measurement)
        self._unbuilt: deque[Lazy] = deque()
        self.device = DeviceMonitor()
        self._log_backlog: deque[Event] = deque(maxlen=LOG_BACKLOG)

    def add_listener(self, listener: Callable[[str, Any], None]) -> None:
        """`listener("batch", BatchRecord)` / `listener("request", dict)` after each record (e.g. /metrics)."""
        self._listeners.append(listener)

    def _tell(self, kind: str, record: Any) -> None:
        for listener in self._listeners:
            try:
                listener(kind, record)
            except Exception:  # an observer must never break the engine
                pass

    # ---- engine side ---------------------------------------------------------------------------------------
    def next_batch_id(self) -> int:
        with self._lock:
            self._batch_ids += 1
            return self._batch_ids

    def count(self, name: str, n: int = 1) -> None:
        with self._lock:
            self.counters[name] = self.counters.get(name, 0) + n

    def emit(self, kind: str, **fields: Any) -> Event:
        event = self.bus.emit(kind, **fields)
        if kind == "log" and not fields.get(PRIVATE):  # the snapshot is for every reader: no logged bodies
            self._log_backlog.append(event)
        return event

    def lazy_tree(self, build: Callable[[], list[dict[str, Any]]]) -> Lazy:
        """A batch tree that is built when someone reads it (`record_batch` keeps the last KEEP_UNBUILT)."""
        return Lazy(build, self._tree_built)

    def _tree_built(self) -> None:
        with self._lock:
            self.trees_built += 1

    def batch_started(self, batch_id: int, model: str, lane: str, request_ids: list[str], tokens: int) -> None:
        with self._lock:
            self.running[f"{model}/{lane}"] = {"batch_id": batch_id, "requests": len(request_ids),
                                               "started": time.time(), "tokens": tokens}
        self.bus.emit("batched", batch_id=batch_id, model=model, lane=lane, request_ids=request_ids, tokens=tokens)

    def batch_failed(self, model: str, lane: str, exc: BaseException) -> None:
        """The lane's batch raised: it no longer runs (`batch_failed` tells the dashboards which one)."""
        with self._lock:
            running = self.running.pop(f"{model}/{lane}", None)
        if running is not None:  # nothing was running when packing failed before `batch_started`
            self.bus.emit("batch_failed", batch_id=running["batch_id"], model=model, lane=lane,
                          error=f"{type(exc).__name__}: {exc}"[:300])

    def memory(self, max_age_s: float = MEMORY_EVERY_S) -> dict[str, int]:
        """Device and host memory, sampled at most every `max_age_s` seconds."""
        now = time.monotonic()
        if now - self._memory_at >= max_age_s:
            sample = host_memory()
            if self.memory_probe is not None:
                try:
                    sample.update(self.memory_probe())
                except Exception:  # a probe must never fail a batch
                    pass
            self._memory, self._memory_at = sample, now
        return dict(self._memory)

    def record_batch(self, record: BatchRecord) -> None:
        if not record.memory:
            record.memory = self.memory()
        forget: Lazy | None = None
        with self._lock:
            self.batches.append(record)
            self.counters["batches"] += 1
            self.counters["forwards"] += record.forwards
            self.running.pop(f"{record.model}/{record.lane}", None)
            if isinstance(record.tree, Lazy):
                self._unbuilt.append(record.tree)
                while self._unbuilt and self._unbuilt[0].built:
                    self._unbuilt.popleft()
                if len(self._unbuilt) > KEEP_UNBUILT:
                    forget = self._unbuilt.popleft()
        if forget is not None:  # an old batch nobody read: its tries go, its tree reads as null
            forget.forget()
        self.bus.emit("computed", **_fields(record))
        self._tell("batch", record)

    # ---- server side ---------------------------------------------------------------------------------------
    def request_received(self, request_id: str, endpoint: str, client: str = "") -> str:
        """Start a request's record; returns its id: the given one, or a fresh one when a recent or running
        request holds it (or it is over 128 characters), so no client overwrites another's record."""
        with self._lock:
            if len(request_id) > 128 or request_id in self._pending or request_id in self._by_id:
                request_id = uuid.uuid4().hex
            info = {"id": request_id, "ts": round(time.time(), 6), "endpoint": endpoint, "client": client[:120]}
            self.totals["received"] += 1
            self.totals["in_flight"] += 1
            self._pending[request_id] = info
        self.bus.emit("received", **info)
        return request_id

    def record_request(self, **info: Any) -> None:
        """Details of an answered request (with questions and answers for the detail view, never the state)."""
        with self._lock:
            self._pending.setdefault(info.get("id", ""), {}).update(info)
        self._tell("request", info)

    def request_finished(self, request_id: str, status: int, error: str = "") -> None:
        """Count the outcome, keep the record, announce it; exactly once per `request_received`."""
        outcome = outcome_of(status)
        with self._lock:
            self.totals["in_flight"] -= 1
            self.totals[outcome] += 1
            record = self._pending.pop(request_id, None) or {"id": request_id, "ts": round(time.time(), 6)}
            record["status"] = status
            if error:
                record["error"] = error[:300]
            if len(self.requests) == self.requests.maxlen:
                old = self.requests[0]
                if self._by_id.get(old["id"]) is old:
                    del self._by_id[old["id"]]
            self.requests.append(record)
            self._by_id[request_id] = record
        kind = "rejected" if outcome in ("rejected", "overloaded") else outcome
        self.bus.emit(kind, **{k: v for k, v in record.items() if k not in DETAIL_KEYS})

    def request(self, request_id: str) -> dict[str, Any] | None:
        """A recent request's record, with its questions and answers (built now if they were recorded Lazy)."""
        with self._lock:
            record = self._by_id.get(request_id)
            record = dict(record) if record is not None else None
        if record is not None:
            detail = record.pop("detail", None)
            if isinstance(detail, Lazy):
                record.update(detail.value() or {})
        return record

    # ---- snapshot ------------------------------------------------------------------------------------------
    def snapshot(self) -> dict[str, Any]:
        # the sequence number first: a client that subscribes `since` it sees every later event
        last_seq = self.bus.history[-1]["seq"] if self.bus.history else 0
        trees_built = self.trees_built  # before this snapshot builds the trees it shows
        with self._lock:
            requests = [{k: v for k, v in r.items() if k not in DETAIL_KEYS} for r in self.requests]
            batches = list(self.batches)
            snap = {"uptime_s": round(time.time() - self.started, 3), "counters": dict(self.counters),
                    "totals": dict(self.totals), "running": {k: dict(v) for k, v in self.running.items()}}
        answered = [r for r in requests if r.get("status") == 200]
        snap["percentiles"] = {
            key: {f"p{q}": percentile([r[key] for r in answered if key in r], q) for q in (50, 95, 99)}
            for key in ("queue_ms", "compute_ms", "total_ms", "planning_ms")}
        snap["percentiles"]["batch_requests"] = {
            f"p{q}": percentile([float(b.requests) for b in batches], q) for q in (50, 95, 99)}
        snap["batches"] = [_fields(b, build=True) for b in batches[-32:]]
        snap["requests"] = requests[-64:]
        snap["last_seq"] = last_seq
        snap["trees_built"] = trees_built
        snap["memory"] = self.memory()
        snap["log"] = [e for e in list(self._log_backlog) if e["seq"] <= last_seq]  # later ones: in the stream
        snap["device_telemetry"] = self.device.sample()  # "device" is the backend's device name
        self.device.follow(self.bus)  # `device` events each second while a dashboard reads the stream
        return snap

"""Engine and server events kept in bounded history, for `/api/stats`, `/api/events`, the headers and the dashboard.

Request counters add up at every instant (one lock): received = answered + failed + rejected (4xx) +
overloaded (529) + cancelled (499) + in_flight. Events go through `EventBus` (bus.py), which never blocks.
"""

from __future__ import annotations

import os
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from .bus import Event, EventBus, Subscription

__all__ = ["BatchRecord", "Event", "EventBus", "Subscription", "Telemetry", "outcome_of", "percentile"]

OUTCOMES = ("answered", "failed", "rejected", "overloaded", "cancelled")
DETAIL_KEYS = ("asked", "answers")  # kept for GET /api/requests/{id}, left out of lists and events
MEMORY_EVERY_S = 1.0  # device memory is sampled at most this often on the batch path


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
    tree: list[dict[str, Any]] = field(default_factory=list)
    replica: int = 0
    device: str = ""
    request_ids: list[str] = field(default_factory=list)
    memory: dict[str, int] = field(default_factory=dict)


def _fields(record: BatchRecord) -> dict[str, Any]:
    """A shallow dict of a record: the tree is shared, never copied (dataclasses.asdict deep-copies it; nobody
    mutates a tree once recorded)."""
    return dict(record.__dict__)


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
        return self.bus.emit(kind, **fields)

    def batch_started(self, batch_id: int, model: str, lane: str, request_ids: list[str], tokens: int) -> None:
        with self._lock:
            self.running[f"{model}/{lane}"] = {"batch_id": batch_id, "requests": len(request_ids),
                                               "started": time.time(), "tokens": tokens}
        self.bus.emit("batched", batch_id=batch_id, model=model, lane=lane, request_ids=request_ids, tokens=tokens)

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
        with self._lock:
            self.batches.append(record)
            self.counters["batches"] += 1
            self.counters["forwards"] += record.forwards
            self.running.pop(f"{record.model}/{record.lane}", None)
        self.bus.emit("computed", **_fields(record))
        self._tell("batch", record)

    # ---- server side ---------------------------------------------------------------------------------------
    def request_received(self, request_id: str, endpoint: str, client: str = "") -> None:
        info = {"id": request_id, "ts": round(time.time(), 6), "endpoint": endpoint, "client": client[:120]}
        with self._lock:
            self.totals["received"] += 1
            self.totals["in_flight"] += 1
            self._pending[request_id] = info
        self.bus.emit("received", **info)

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
        with self._lock:
            record = self._by_id.get(request_id)
            return dict(record) if record is not None else None

    # ---- snapshot ------------------------------------------------------------------------------------------
    def snapshot(self) -> dict[str, Any]:
        # the sequence number first: a client that subscribes `since` it sees every later event
        last_seq = self.bus.history[-1]["seq"] if self.bus.history else 0
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
        snap["batches"] = [_fields(b) for b in batches[-32:]]
        snap["requests"] = requests[-64:]
        snap["last_seq"] = last_seq
        snap["memory"] = self.memory()
        return snap

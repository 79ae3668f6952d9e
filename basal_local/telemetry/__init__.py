"""Engine and server events kept in bounded history, for `/api/stats`, the headers and the dashboard."""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any


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


class Telemetry:
    def __init__(self, history: int = 256) -> None:
        self._lock = threading.Lock()
        self.batches: deque[BatchRecord] = deque(maxlen=history)
        self.requests: deque[dict[str, Any]] = deque(maxlen=history)
        self.counters: dict[str, int] = {"requests": 0, "answered": 0, "failed": 0, "cancelled": 0,
                                         "rejected_overload": 0, "forwards": 0, "batches": 0}
        self.started = time.time()
        self._batch_ids = 0
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

    def next_batch_id(self) -> int:
        with self._lock:
            self._batch_ids += 1
            return self._batch_ids

    def count(self, name: str, n: int = 1) -> None:
        with self._lock:
            self.counters[name] = self.counters.get(name, 0) + n

    def record_batch(self, record: BatchRecord) -> None:
        with self._lock:
            self.batches.append(record)
            self.counters["batches"] += 1
            self.counters["forwards"] += record.forwards
        self._tell("batch", record)

    def record_request(self, **info: Any) -> None:
        with self._lock:
            self.requests.append(info)
        self._tell("request", info)

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            return {"uptime_s": round(time.time() - self.started, 3), "counters": dict(self.counters),
                    "batches": [asdict(b) for b in list(self.batches)[-32:]],
                    "requests": list(self.requests)[-64:]}

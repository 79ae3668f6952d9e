"""What the dashboard knows: the last stats snapshot plus everything the event stream said since.

Plain Python, no Textual: `DashboardData.apply(event)` folds one event in, `load_stats(snapshot)` takes a
`/api/stats` answer. Rates come from per-second buckets keyed by the events' own timestamps, so canned
events give the same picture every time. Everything is bounded.
"""

from __future__ import annotations

import bisect
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

MAX_REQUESTS = 500
MAX_BATCHES = 40
MAX_LOG = 1000
SERIES_S = 120  # seconds of sparkline history
RECENT_S = 10.0  # the state cache's "now" hit rate: over the stats polls of the last this many seconds
# the counters of a state cache (/api/stats models[i]["prefix_cache"]) that add up over replicas and models
CACHE_SUMS = ("budget_bytes", "bytes", "nodes", "tokens", "hits", "misses", "hit_tokens", "evictions")
CACHE_COUNTERS = ("hits", "misses", "hit_tokens", "evictions")  # what `c` starts over
TERMINAL = {"answered", "failed", "rejected", "cancelled"}
MODEL_EVENTS = {"model_loading": "loading", "model_loaded": "loaded", "model_load_failed": "failed",
                "model_unloading": "unloading", "model_unloaded": "unloaded"}
KNOWN_CLIENTS = {"python-httpx": "httpx", "python-urllib": "urllib", "basal-client-python": "basal-client",
                 "python-requests": "requests"}


def client_name(user_agent: str) -> str:
    """A short client name from a User-Agent: `typesafe-sdk/0.7.5` -> `typesafe-sdk`."""
    ua = (user_agent or "").strip()
    if not ua:
        return "-"
    if "aiohttp" in ua:
        return "aiohttp"
    first = ua.split()[0].split("/")[0]
    return KNOWN_CLIENTS.get(first.lower(), first)[:20]


def percentile(values: list[float], q: float) -> float | None:
    """Nearest-rank percentile, as the daemon computes it."""
    if not values:
        return None
    ordered = sorted(values)
    rank = max(1, -(-len(ordered) * q // 100))
    return ordered[int(min(rank, len(ordered))) - 1]


def _short(request_id: str, width: int = 12) -> str:
    return request_id if len(request_id) <= width else request_id[: width - 1] + "\u2026"


def access_line(ts: float, row: dict[str, Any]) -> LogLine:
    """`200 systemone typesafe-sdk 2 q 61 ms req-1`: a finished request as an access-log line."""
    status = row.get("status", "-")
    total = row.get("total_ms")
    parts = [str(status), str(row.get("endpoint") or "-"), client_name(row.get("client", "")),
             f"{row.get('questions', '-')} q", f"{total:.0f} ms" if isinstance(total, int | float) else "- ms",
             _short(str(row.get("id")))]
    level = "INFO" if isinstance(status, int) and status < 400 else "WARNING"
    return LogLine(ts, level, "access", " ".join(parts))


@dataclass(eq=False)  # hashed by identity: the log view keeps a set of the lines it has written
class LogLine:
    ts: float
    level: str
    source: str
    message: str


@dataclass
class DashboardData:
    clock: Callable[[], float] = time.time
    url: str = ""
    connected: bool = False
    error: str = ""
    stats: dict[str, Any] = field(default_factory=dict)
    stats_at: float = 0.0
    requests: OrderedDict[str, dict[str, Any]] = field(default_factory=OrderedDict)
    batches: deque[dict[str, Any]] = field(default_factory=lambda: deque(maxlen=MAX_BATCHES))
    running: dict[str, dict[str, Any]] = field(default_factory=dict)
    log: deque[LogLine] = field(default_factory=lambda: deque(maxlen=MAX_LOG))
    # one line per finished request, built from the event stream (the log view's `a`; no --access-log needed)
    access: deque[LogLine] = field(default_factory=lambda: deque(maxlen=MAX_LOG))
    device: dict[str, Any] = field(default_factory=dict)  # the daemon's last device sample (telemetry/device.py)
    # second -> {"requests", "decisions", "tokens", "errors", "overloaded"}
    buckets: dict[int, dict[str, float]] = field(default_factory=dict)
    latencies: deque[tuple[float, float]] = field(default_factory=lambda: deque(maxlen=500))
    # requests per batch -> batches seen (the batches view's histogram), since attach or the last clear
    batch_sizes: dict[int, int] = field(default_factory=dict)
    # the daemon's totals when `c` cleared the stats: the views show counters since then
    baseline: dict[str, int] = field(default_factory=dict)
    cleared_at: float | None = None
    # the state caches' counters when `c` cleared the stats, by model (or "model/rN")
    cache_baseline: dict[str, dict[str, int]] = field(default_factory=dict)
    # model (or "model/rN") -> (clock, hits, misses) of the last stats polls: the cache's recent hit rate
    cache_polls: dict[str, deque[tuple[float, int, int]]] = field(default_factory=dict)
    # model -> its status ("loaded", "loading", "unloading", "unloaded", "failed") from /api/stats model_states,
    # and from the model_* events between two polls
    model_status: dict[str, str] = field(default_factory=dict)
    last_seq: int = 0
    events_seen: int = 0
    version: int = 0  # bumped on every change, so views redraw only when something happened

    # ---- input -------------------------------------------------------------------------------------------
    def load_stats(self, snap: dict[str, Any]) -> None:
        first = not self.stats
        self.stats = snap
        self.stats_at = self.clock()
        if isinstance(snap.get("device_telemetry"), dict):
            self.device = snap["device_telemetry"]
        # a daemon with run-time models (server/models.py) lists them; the poll is the truth as of now
        self.model_status = {str(e["name"]): str(e.get("status", "")) for e in snap.get("model_states") or []
                             if isinstance(e, dict) and e.get("name")}
        for label, cache in self.caches(per_replica=True) + [("", self.cache_total())]:
            if cache.get("enabled"):
                polls = self.cache_polls.setdefault(label, deque(maxlen=64))
                polls.append((self.stats_at, int(cache.get("hits", 0)), int(cache.get("misses", 0))))
        if first:
            for event in snap.get("log", []):  # the daemon's log from before we attached (start-up, loading)
                self.add_log(LogLine(float(event.get("ts", 0.0)), event.get("level", "INFO"),
                                     event.get("logger", ""), event.get("message", "")))  # history from before we attached: the table and the batch view are not empty
            for record in snap.get("requests", []):
                row = self._row(record["id"], record.get("ts", 0.0))
                row.update({k: v for k, v in record.items() if k != "id"})
                if record.get("status") == 200 and "queue_ms" in record:
                    self.latencies.append((record["queue_ms"], record.get("compute_ms", 0.0)))
            for batch in snap.get("batches", []):
                self.batches.append(batch)
                self._count_batch(batch)
            self.last_seq = max(self.last_seq, int(snap.get("last_seq", 0)))
        self.version += 1

    def set_connected(self, connected: bool, error: str = "") -> None:
        if connected != self.connected:
            text = f"connected to {self.url}" if connected else f"disconnected from {self.url}: {error}"
            self.add_log(LogLine(self.clock(), "INFO" if connected else "WARNING", "dashboard", text))
        self.connected = connected
        self.error = error
        self.version += 1

    def apply(self, event: dict[str, Any]) -> None:
        kind = event.get("kind", "")
        ts = float(event.get("ts", 0.0))
        self.events_seen += 1
        self.last_seq = max(self.last_seq, int(event.get("seq", 0) or 0))
        self.version += 1
        if kind == "received":
            row = self._row(event["id"], ts)
            row.update(endpoint=event.get("endpoint", ""), client=event.get("client", ""), status="received")
        elif kind == "planned":
            row = self._row(event["id"], ts)
            row.update({k: event[k] for k in ("model", "questions", "input_tokens", "packed_tokens", "planning_ms")
                        if k in event})
            row["status"] = "planned"
        elif kind == "queued":
            row = self._row(event["id"], ts)
            row.update(lane=event.get("lane", ""), model=event.get("model", row.get("model")), status="queued")
        elif kind == "batched":
            self.running[f"{event.get('model')}/{event.get('lane')}"] = event
            for rid in event.get("request_ids", []):
                row = self.requests.get(rid)
                if row is not None and row.get("status") not in TERMINAL:
                    row.update(batch_id=event.get("batch_id"), status="computing")
        elif kind == "computed":
            self.running.pop(f"{event.get('model')}/{event.get('lane')}", None)
            self.batches.append(event)
            self._count_batch(event)
            self._bucket(ts)["tokens"] += event.get("packed_tokens", 0)
        elif kind == "batch_failed":  # no `computed` follows: the lane is not running it any more
            key = f"{event.get('model')}/{event.get('lane')}"
            if self.running.get(key, {}).get("batch_id") == event.get("batch_id"):
                del self.running[key]
            self.add_log(LogLine(ts, "ERROR", "engine",
                                 f"batch {event.get('batch_id')} failed in {key}: {event.get('error', '')}"))
        elif kind in TERMINAL:
            row = self._row(event["id"], ts)
            row.update({k: v for k, v in event.items() if k not in ("kind", "seq", "ts", "id")})
            row["done_ts"] = ts
            status = int(event.get("status", 0))
            bucket = self._bucket(ts)
            if kind == "answered":
                bucket["requests"] += 1
                bucket["decisions"] += int(event.get("questions", 0) or 0)
                queue_ms, compute_ms = float(event.get("queue_ms", 0.0)), float(event.get("compute_ms", 0.0))
                self.latencies.append((queue_ms, compute_ms))
                bucket["queue_ms"] = max(bucket["queue_ms"], queue_ms)  # the sparklines show each second's worst
                bucket["compute_ms"] = max(bucket["compute_ms"], compute_ms)
            elif status == 529:
                bucket["overloaded"] += 1
            elif kind == "failed":
                bucket["errors"] += 1
            if kind in ("failed", "rejected"):
                level = "ERROR" if kind == "failed" else "WARNING"
                self.add_log(LogLine(ts, level, "request", f"{event['id']} {status} {event.get('error', '')}"))
            self.access.append(access_line(ts, row))
        elif kind == "log":
            self.add_log(LogLine(ts, event.get("level", "INFO"), event.get("logger", ""), event.get("message", "")))
        elif kind in MODEL_EVENTS:  # a model loads or unloads at run time (the daemon's log says it in words)
            self.model_status[str(event.get("model", ""))] = MODEL_EVENTS[kind]
        elif kind == "device":
            self.device = {k: v for k, v in event.items() if k not in ("kind", "seq", "ts")}
        elif kind == "dropped":
            self.add_log(LogLine(ts, "WARNING", "dashboard",
                                 f"the dashboard fell behind: {event.get('count')} events lost"))

    def clear(self) -> None:
        """`c`: start the statistics over (the daemon keeps its own): counters, rates and sparklines, latency
        percentiles, the batch-size histogram, finished requests and past batches. Requests still in flight,
        running batches, the log and the daemon's identity stay."""
        self.baseline = {k: int(v) for k, v in self.stats.get("totals", {}).items()}
        self.cache_baseline = {}  # caches() below reads the daemon's own counters
        self.cache_baseline = {label: {k: int(cache.get(k, 0) or 0) for k in CACHE_COUNTERS}
                               for label, cache in self.caches(per_replica=True) + self.caches()}
        self.cache_polls.clear()
        self.cleared_at = self.clock()
        self.buckets.clear()
        self.latencies.clear()
        self.batch_sizes.clear()
        self.batches.clear()
        for request_id in [r for r, row in self.requests.items() if row.get("done_ts") or isinstance(
                row.get("status"), int)]:
            del self.requests[request_id]
        self.add_log(LogLine(self.clock(), "INFO", "dashboard", "statistics cleared (the daemon's are untouched)"))
        self.version += 1

    def add_log(self, line: LogLine) -> None:
        """Keep the log in time order: the backlog, the stream and the dashboard's own notes interleave."""
        if not self.log or self.log[-1].ts <= line.ts:
            self.log.append(line)
            return
        lines = list(self.log)
        lines.insert(bisect.bisect_right([x.ts for x in lines], line.ts), line)
        self.log = deque(lines[-MAX_LOG:], maxlen=MAX_LOG)

    def total(self, name: str) -> int:
        """A daemon counter since the last clear (all of it before any)."""
        return int(self.stats.get("totals", {}).get(name, 0)) - self.baseline.get(name, 0)

    def _count_batch(self, batch: dict[str, Any]) -> None:
        size = int(batch.get("requests", 0) or 0)
        if size > 0:
            self.batch_sizes[size] = self.batch_sizes.get(size, 0) + 1

    def _row(self, request_id: str, ts: float) -> dict[str, Any]:
        row = self.requests.get(request_id)
        if row is None:
            row = {"id": request_id, "ts": ts}
            self.requests[request_id] = row
            while len(self.requests) > MAX_REQUESTS:
                self.requests.popitem(last=False)
        return row

    def _bucket(self, ts: float) -> dict[str, float]:
        second = int(ts)
        bucket = self.buckets.get(second)
        if bucket is None:
            bucket = self.buckets[second] = {"requests": 0, "decisions": 0, "tokens": 0, "errors": 0,
                                             "overloaded": 0, "queue_ms": 0.0, "compute_ms": 0.0}
            for old in [s for s in self.buckets if s < second - SERIES_S]:
                del self.buckets[old]
        return bucket

    # ---- views -------------------------------------------------------------------------------------------
    def series(self, name: str, seconds: int = 60) -> list[float]:
        """Per-second values of the last `seconds` complete seconds (oldest first)."""
        now = int(self.clock())
        return [self.buckets.get(s, {}).get(name, 0) for s in range(now - seconds, now)]

    def rate(self, name: str, seconds: int = 5) -> float:
        return sum(self.series(name, seconds)) / seconds

    def latency(self, which: int, q: float) -> float | None:
        return percentile([lat[which] for lat in self.latencies], q)

    def uptime(self) -> float | None:
        if "uptime_s" not in self.stats:
            return None
        return float(self.stats["uptime_s"]) + (self.clock() - self.stats_at if self.connected else 0.0)

    def caches(self, per_replica: bool = False) -> list[tuple[str, dict[str, Any]]]:
        """(label, state cache) per model, or per replica ("model/r1") where a model has several; the counters
        since `c` where it was pressed."""
        out = []
        for entry in self.stats.get("models", []):
            name = str(entry.get("name", ""))
            replicas = [r for r in entry.get("replicas") or [] if isinstance(r.get("prefix_cache"), dict)]
            if per_replica and len(replicas) > 1:
                out += [(f"{name}/r{r.get('replica', n)}", r["prefix_cache"]) for n, r in enumerate(replicas)]
            elif isinstance(entry.get("prefix_cache"), dict):
                out.append((name, entry["prefix_cache"]))
        return [(label, self._since_clear(label, cache)) for label, cache in out]

    def _since_clear(self, label: str, cache: dict[str, Any]) -> dict[str, Any]:
        base = self.cache_baseline.get(label)
        if not base:
            return cache
        now = {k: int(cache.get(k, 0) or 0) for k in CACHE_COUNTERS}
        if any(now[k] < v for k, v in base.items()):  # the daemon restarted: its counters began again
            return cache
        return {**cache, **{k: now[k] - base[k] for k in CACHE_COUNTERS}}

    def replicas(self) -> list[dict[str, Any]]:
        """Every model's replicas (device, memory figures, state cache), as `/api/stats` lists them."""
        return [r for entry in self.stats.get("models", []) for r in entry.get("replicas") or []]

    def cache_total(self) -> dict[str, Any]:
        """Every model's state cache added up (the one-line summary); `enabled` when any is on."""
        caches = [c for _, c in self.caches()]
        total: dict[str, Any] = {k: sum(int(c.get(k, 0) or 0) for c in caches if c.get("enabled"))
                                 for k in CACHE_SUMS}
        total["enabled"] = any(c.get("enabled") for c in caches)
        settings = sorted({str(c.get("setting", "")) for c in caches if c.get("setting")})
        total["setting"] = settings[0] if len(settings) == 1 else ("mixed" if settings else "")
        return total

    def recent_hit_rate(self, label: str, seconds: float = RECENT_S) -> float | None:
        """Hits / lookups between the stats polls of the last `seconds` (None: too few polls, or no lookups)."""
        polls = self.cache_polls.get(label)
        if not polls or len(polls) < 2:
            return None
        now = polls[-1][0]
        first = next((p for p in polls if now - p[0] <= seconds + 0.5), polls[-1])
        hits, misses = polls[-1][1] - first[1], polls[-1][2] - first[2]
        if hits < 0 or misses < 0 or hits + misses == 0:  # a restarted daemon counts from 0 again
            return None
        return hits / (hits + misses)

    def model_states(self) -> list[dict[str, Any]]:
        """The daemon's known models (`/api/stats` model_states: status, keep-alive, idle time, error), each with
        its latest status (an event may have come since the poll); empty for a daemon without run-time models."""
        states = [dict(e) for e in self.stats.get("model_states") or [] if isinstance(e, dict) and e.get("name")]
        for entry in states:
            entry["status"] = self.model_status.get(str(entry["name"]), entry.get("status", ""))
        listed = {str(e["name"]) for e in states}
        states += [{"name": name, "status": status} for name, status in self.model_status.items() if name not in listed]
        return states

    def thresholds(self, model: str) -> dict[str, float]:
        for entry in self.stats.get("models", []):
            if entry.get("name") == model:
                return entry.get("calibration", {}).get("thresholds", {})
        return {}

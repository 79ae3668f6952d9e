"""Prometheus metrics at /metrics (`serve --metrics`), their names declared below; a per-app registry.

Labels carry only served model names, endpoints, lanes and status codes: never request content. The HTTP counters
name the served model a request was routed to, whatever its status (a 422, a 499, a 200); an answer that never
reached a served model (an unknown model's, a malformed body, a 529 or a 503 before routing) is under model="".
"""

from __future__ import annotations

from litestar import Request, Response, get
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from .state import AppState

SECONDS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0,
           300.0, 600.0)
SIZES = tuple(float(2 ** i) for i in range(11))  # 1 .. 1024


class MetricsRecorder:
    """HTTP metrics from the middleware, usage and lane metrics from telemetry records."""

    def __init__(self, state: AppState) -> None:
        self.state = state
        r = self.registry = CollectorRegistry()
        self.requests = Counter("basal_http_requests", "Decision requests by endpoint, model and status",
                                ["endpoint", "model", "status"], registry=r)
        self.duration = Histogram("basal_http_request_duration_seconds", "Entry to built response",
                                  ["endpoint", "model", "status"], buckets=SECONDS, registry=r)
        self.inflight = Gauge("basal_http_inflight_requests", "Decision requests being handled", ["endpoint"],
                              registry=r)
        self.model_inflight = Gauge("basal_model_inflight_requests", "Requests waiting in the model's lanes", ["model"],
                                    registry=r)
        self.max_inflight = Gauge("basal_max_inflight_requests", "Admission limit (--max-inflight)", registry=r)
        self.max_inflight.set(state.max_inflight)
        self.input_tokens = Counter("basal_input_tokens", "Prompt tokens, API semantics (shared prefixes "
                                    "counted per prompt)", ["model"], registry=r)
        self.output_tokens = Counter("basal_output_tokens", "Generated tokens (always 0)", ["model"], registry=r)
        self.questions = Counter("basal_questions", "Questions answered", ["model"], registry=r)
        self.described: list[tuple[str, list]] = []  # each engine described once per scrape (render)
        r.register(_CacheCollector(self))
        self.queue = Histogram("basal_queue_duration_seconds", "Arrival to start of batch", ["model", "lane"],
                               buckets=SECONDS, registry=r)
        self.batch = Histogram("basal_batch_duration_seconds", "Batch compute, gate waits included",
                               ["model", "lane", "outcome"], buckets=SECONDS, registry=r)
        self.batch_requests = Histogram("basal_batch_requests", "Requests per batch", ["model", "lane"],
                                        buckets=SIZES, registry=r)
        self.lanes: dict[int, str] = {}
        state.telemetry.add_listener(self.on_record)

    # -- middleware side
    def enter(self, endpoint: str) -> None:
        self.inflight.labels(endpoint).inc()

    def leave(self, endpoint: str, status: int, seconds: float, routed: str = "") -> None:
        """One decision answered; `routed`: the served model its handler routed it to ("" when none)."""
        self.inflight.labels(endpoint).dec()
        model = routed if routed in self.state.engines else ""
        code = "cancelled" if status == 499 else str(status)
        self.requests.labels(endpoint, model, code).inc()
        if code != "cancelled":
            self.duration.labels(endpoint, model, code).observe(seconds)

    # -- telemetry side (engine threads)
    def on_record(self, kind: str, record) -> None:
        if kind == "batch":
            self.lanes[record.batch_id] = record.lane
            if len(self.lanes) > 4096:
                for key in sorted(self.lanes)[:2048]:
                    del self.lanes[key]
            self.batch.labels(record.model, record.lane, "ok").observe(record.compute_ms / 1000.0)
            self.batch_requests.labels(record.model, record.lane).observe(record.requests)
        elif kind == "request":
            model = record.get("model", "")
            lane = self.lanes.get(record.get("batch_id"), "main")
            self.input_tokens.labels(model).inc(record.get("input_tokens", 0))
            self.output_tokens.labels(model).inc(0)
            self.questions.labels(model).inc(record.get("questions", 0))
            self.queue.labels(model, lane).observe(record.get("queue_ms", 0.0) / 1000.0)

    def render(self) -> bytes:
        self.described = [(name, engine.describe()) for name, engine in list(self.state.engines.items())]
        for name, replicas in self.described:
            self.model_inflight.labels(name).set(sum(r["requests"] for r in replicas))
        return generate_latest(self.registry)


# the state cache's figures per replica (engine/prefix_cache.py): (its key, the metric's name, its help)
CACHE_COUNTERS = (("hits", "basal_prefix_cache_hits", "Requests that continued a cached document"),
                  ("misses", "basal_prefix_cache_misses", "Requests that did not"),
                  ("hit_tokens", "basal_prefix_cache_hit_tokens", "Tokens read from the cache instead of computed"),
                  ("evictions", "basal_prefix_cache_evictions", "Cached prefixes evicted for room"))
CACHE_GAUGES = (("bytes", "basal_prefix_cache_bytes", "Memory held by cached prefixes"),
                ("peak_bytes", "basal_prefix_cache_peak_bytes", "The most memory cached prefixes ever held at once"),
                ("budget_bytes", "basal_prefix_cache_budget_bytes", "The cache's memory budget (--prefix-cache)"),
                ("nodes", "basal_prefix_cache_nodes", "Cached prefixes (templates included)"))


class _CacheCollector:
    """The engines' state caches, read at each scrape. Hits, misses, hit tokens and evictions are counters (their
    `_total` series typed `counter`, so `rate()` works; a reloaded model starts them again at 0, which Prometheus
    reads as a counter reset), the rest gauges."""

    def __init__(self, recorder: MetricsRecorder) -> None:
        self.recorder = recorder

    def collect(self):
        families = [(key, CounterMetricFamily(name, text, labels=["model", "replica"]))
                    for key, name, text in CACHE_COUNTERS]
        families += [(key, GaugeMetricFamily(name, text, labels=["model", "replica"]))
                     for key, name, text in CACHE_GAUGES]
        for model, replicas in self.recorder.described:
            for r in replicas:
                cache, labels = r.get("prefix_cache") or {}, [model, str(r.get("replica", 0))]
                for key, family in families:
                    family.add_metric(labels, cache.get(key, 0))
        for _, family in families:
            yield family


@get("/metrics")
async def metrics_handler(request: Request) -> Response:
    state: AppState = request.app.state.basal
    recorder: MetricsRecorder = state.metrics_recorder  # type: ignore[attr-defined]
    # prometheus_client's type already names its charset; Litestar would add a second one, which strict parsers
    # (Go's mime.ParseMediaType, so Prometheus) refuse
    return Response(content=recorder.render(), status_code=200, media_type=CONTENT_TYPE_LATEST.split(";")[0],
                    headers={"content-type": CONTENT_TYPE_LATEST})

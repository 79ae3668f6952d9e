"""Canned daemon data for the dashboard tests: a stats snapshot, an event stream, request details.

Shapes are those of the daemon's `/api/stats`, `/api/events` and `/api/requests/{id}` (test_events.py checks
the live daemon against the same keys). Times are fixed: the app gets `clock=lambda: NOW`.
"""

from __future__ import annotations

import asyncio
import copy
import time
from typing import Any

import pytest

T0 = 1_800_000_000.0  # 2027-01-15 08:00:00 UTC
NOW = T0 + 10.0
MODEL = "basal-demo"


def _order(rid: str, qid: str, order: int, tokens: int = 6) -> dict[str, Any]:
    return {"tokens": tokens, "start": 0, "kind": "order", "owners": [[rid, qid, order]]}


def _question(rid: str, qid: str, tokens: int) -> dict[str, Any]:
    return {"tokens": tokens, "start": 0, "kind": "question", "children": [_order(rid, qid, 0), _order(rid, qid, 1)]}


def batch_event(batch_id: int, ts: float, rids: list[str], cached_state: int = 0) -> dict[str, Any]:
    """A computed batch: one Polish row, one state per request, two questions per state. With `cached_state`
    (its tokens) the requests ask about one document the state cache holds: the row continues the cached
    template + state, so only the questions and their orders are computed."""
    if cached_state:
        blocks = [q for rid in rids for q in (_question(rid, "kind", 14), _question(rid, "urgent", 9))]
        packed = len(rids) * (14 + 9 + 4 * 6)
        unpacked = len(rids) * (4 * (57 + cached_state) + 2 * 14 + 2 * 9 + 4 * 6)
    else:
        blocks = [{"tokens": 100 + 10 * n, "start": 0, "kind": "state",
                   "children": [_question(rid, "kind", 14), _question(rid, "urgent", 9)]} for n, rid in enumerate(rids)]
        packed = sum(s["tokens"] + 14 + 9 + 4 * 6 for s in blocks)
        unpacked = sum(4 * (57 + s["tokens"]) + 2 * 14 + 2 * 9 + 4 * 6 for s in blocks)
    cached = 57 + cached_state  # tokens the row continues from a cached node: the template (+ the state)
    return {"kind": "computed", "ts": ts, "batch_id": batch_id, "model": MODEL, "lane": "main",
            "requests": len(rids), "questions": 2 * len(rids), "prompts": 4 * len(rids), "forwards": 1,
            "packed_tokens": packed, "unpacked_tokens": unpacked, "compute_ms": 42.5 + batch_id, "started": ts,
            "request_ids": rids, "memory": {"host_rss_bytes": 512 * 2**20},
            "tree": [{"lang": "pl", "prefix": "pl", "prefix_tokens": cached, "cached_tokens": cached,
                      "cache_hit": bool(cached_state), "tokens": packed, "prompts": 4 * len(rids),
                      "children": blocks}]}


def request_events(rid: str, ts: float, client: str, batch: int, size: int, status: int = 200,
                   cached: int = 57) -> list[dict]:
    out = [{"kind": "received", "ts": ts, "id": rid, "endpoint": "systemone", "client": client}]
    if status != 200:
        kind = "rejected" if status < 500 or status == 529 else "failed"
        return out + [{"kind": kind, "ts": ts + 0.002, "id": rid, "status": status, "endpoint": "systemone",
                       "client": client, "error": '{"detail": "bad"}' if status == 422 else "overloaded"}]
    out += [{"kind": "planned", "ts": ts + 0.001, "id": rid, "model": MODEL, "questions": 2, "input_tokens": 480,
             "packed_tokens": 180, "planning_ms": 1.25},
            {"kind": "queued", "ts": ts + 0.002, "id": rid, "model": MODEL, "lane": "main"},
            {"kind": "answered", "ts": ts + 0.2, "id": rid, "status": 200, "model": MODEL, "endpoint": "systemone",
             "client": client, "questions": 2, "input_tokens": 480, "packed_tokens": 180, "planning_ms": 1.25,
             "queue_ms": 12.0 + batch, "compute_ms": 42.5 + batch, "total_ms": 60.0 + batch, "batch_id": batch,
             "batch_requests": size, "cached_tokens": cached}]
    return out


def canned_events() -> list[dict[str, Any]]:
    events: list[dict[str, Any]] = []
    clients = ["typesafe-sdk/0.7.5", "basal-client-python", "jev-cli/0.7.0"]
    for n in range(3):
        events += request_events(f"req-{n:04d}", T0 + n * 0.01, clients[n], 1, 3)
    events.append({"kind": "batched", "ts": T0 + 0.05, "batch_id": 1, "model": MODEL, "lane": "main",
                   "request_ids": ["req-0000", "req-0001", "req-0002"], "tokens": 500})
    events.append(batch_event(1, T0 + 0.1, ["req-0000", "req-0001", "req-0002"]))
    for n in range(3, 5):
        events += request_events(f"req-{n:04d}", T0 + 5 + n * 0.01, "python-httpx/0.28.1", 2, 2, cached=57 + 100)
    events.append(batch_event(2, T0 + 5.1, ["req-0003", "req-0004"], cached_state=100))  # a state cache hit
    events += request_events("req-0005", T0 + 6, "curl/8.5.0", 0, 0, status=422)
    events += request_events("req-0006", T0 + 7, "curl/8.5.0", 0, 0, status=529)
    events.append({"kind": "log", "ts": T0 + 8, "level": "INFO", "logger": "basal_local.daemon",
                   "message": "loaded basal-demo from /models/demo: 2 layers, f32 on cpu"})
    events.sort(key=lambda e: e["ts"])
    for seq, event in enumerate(events, 1):
        event["seq"] = seq
    return events


# the state cache of a model (and of each replica): /api/stats models[i]["prefix_cache"]
CACHE: dict[str, Any] = {"enabled": True, "setting": "auto", "budget_bytes": 12 * 2**30, "bytes": 6 * 2**30,
                         "nodes": 37, "tokens": 48_213, "hits": 412, "misses": 150, "hit_tokens": 1_234_567,
                         "evictions": 9}

STATS: dict[str, Any] = {
    "version": "0.1.0", "ready": True, "load_error": None, "uptime_s": 3725.0, "backend": "torch", "device": "cpu",
    "dtype": "f32", "default_model": MODEL, "inflight": 1, "subscribers": 1, "last_seq": 0,
    "limits": {"max_inflight": 1024, "max_body_bytes": 32 * 2**20},
    "totals": {"received": 8, "answered": 5, "failed": 0, "rejected": 1, "overloaded": 1, "cancelled": 0,
               "in_flight": 1},
    "counters": {"batches": 2, "forwards": 2, "cancelled": 0},
    "running": {}, "percentiles": {},
    # the backend's memory() (weights, CUDA graphs' pool, state cache) as a GPU daemon reports it
    "memory": {"host_rss_bytes": 512 * 2**20, "weights_bytes": 8 * 2**30 + 512 * 2**20,
               "graphs_bytes": 1536 * 2**20, "prefix_cache_bytes": 6 * 2**30,
               "device_allocated_bytes": 17 * 2**30},
    # telemetry/device.py's sample as an NVIDIA host sends it (the canned model itself runs on the CPU)
    "device_telemetry": {"type": "nvidia", "cpus": 16, "cpu_percent": 112.0, "rss_bytes": 512 * 2**20,
                         "gpus": [{"index": 0, "name": "NVIDIA H200", "util_percent": 87, "power_w": 412.0,
                                   "power_limit_w": 700.0, "clock_mhz": 1980, "temperature_c": 54,
                                   "memory_used_bytes": 24 * 2**30, "memory_total_bytes": 140 * 2**30,
                                   "memory_free_bytes": 116 * 2**30}]},
    "queues": {MODEL: {"main": {"waiting": 2, "waiting_tokens": 360, "oldest_wait_ms": 35.0,
                                "running": {"batch_id": 3, "requests": 4, "tokens": 700}},
                       "long": {"waiting": 0, "waiting_tokens": 0, "oldest_wait_ms": 0.0, "running": {}}}},
    "models": [{"name": MODEL, "path": "/models/demo", "version": "1.5", "layers": 2, "hidden_size": 64,
                "vocab_size": 512, "max_positions": 4096, "default": True,
                "port": {"format": "bf16", "bits": 16, "dense_layers": [], "quantization": {},
                         "calibration_file": "CALIBRATION.json", "calibration_inherited": False},
                "calibration": {"present": True, "temperatures": {"choice": 1.1388, "noul": 1.394},
                                "thresholds": {"0.01": 0.955, "0.05": 0.763}},
                "engine": {"max_batch_tokens": 8192, "schedule": "hrrn", "long_tokens": 4096, "long_slice_ms": 100.0,
                           "max_row_tokens": 32768, "max_forward_tokens": 8192, "prefix_cache": "auto"},
                "prefix_cache": CACHE,
                "replicas": [{"replica": 0, "device": "cuda:0", "alive": True, "prefix_cache": CACHE,
                              "memory": {"weights_bytes": 8 * 2**30 + 512 * 2**20, "graphs_bytes": 1536 * 2**20,
                                         "prefix_cache_bytes": 6 * 2**30, "device_allocated_bytes": 17 * 2**30}}]}],
    "requests": [], "batches": [],
}


def two_replicas(stats: dict[str, Any] | None = None) -> dict[str, Any]:
    """The snapshot of a model served by two replicas on two GPUs, each with its own state cache."""
    stats = copy.deepcopy(stats or STATS)
    second = {**CACHE, "bytes": 2 * 2**30, "nodes": 11, "tokens": 15_020, "hits": 88, "misses": 120,
              "hit_tokens": 301_000, "evictions": 0}
    model = stats["models"][0]
    memory = {k: v for k, v in stats["memory"].items() if k != "host_rss_bytes"}
    model["replicas"] = [{"replica": 0, "device": "cuda:0", "alive": True, "prefix_cache": dict(CACHE),
                          "memory": memory},
                         {"replica": 1, "device": "cuda:1", "alive": True, "prefix_cache": second,
                          "memory": {**memory, "prefix_cache_bytes": 2 * 2**30}}]
    model["prefix_cache"] = {**CACHE, **{k: CACHE[k] + second[k] for k in
                                         ("budget_bytes", "bytes", "nodes", "tokens", "hits", "misses", "hit_tokens",
                                          "evictions")}}
    lanes = stats["queues"][MODEL]  # each replica's lanes ("main-r1": replica 1's main lane)
    lanes.update({f"{lane}-r1": copy.deepcopy(queue) for lane, queue in list(lanes.items())})
    gpu = stats["device_telemetry"]["gpus"][0]
    stats["device_telemetry"]["gpus"].append({**gpu, "index": 1, "util_percent": 64,
                                             "memory_used_bytes": 20 * 2**30, "memory_free_bytes": 120 * 2**30})
    return stats


def run_time_models(stats: dict[str, Any] | None = None) -> dict[str, Any]:
    """The snapshot of a daemon with run-time models (server/models.py's model_states): the served model with a
    keep-alive, a second one loading, a third that failed to load."""
    stats = copy.deepcopy(stats or STATS)
    common = {"since": T0, "idle_s": None, "expires_in_s": None, "load_s": None, "error": None, "default": False}
    stats["model_states"] = [
        {**common, "name": MODEL, "status": "loaded", "path": "/models/demo", "keep_alive_s": 300.0, "idle_s": 180.0,
         "expires_in_s": 120.0, "load_s": 1.5, "default": True},
        {**common, "name": "basal-4.5B", "status": "loading", "path": "/models/4.5B", "keep_alive_s": 300.0},
        {**common, "name": "basal-max", "status": "failed", "path": "/models/max", "keep_alive_s": 300.0,
         "error": "the weights need 62.1 GiB, the GPU has 24.0 GiB free"}]
    return stats


def detail(request_id: str) -> dict[str, Any]:
    return {"id": request_id, "status": 200, "model": MODEL, "endpoint": "systemone", "client": "typesafe-sdk/0.7.5",
            "ts": T0, "input_tokens": 480, "packed_tokens": 180, "planning_ms": 1.25,
            "queue_ms": 13.0, "compute_ms": 43.5, "total_ms": 61.0, "batch_id": 1, "batch_requests": 3,
            "asked": [{"id": "kind", "type": "choice", "instructions": "Jaki jest rodzaj zgłoszenia?",
                           "options": [["damage", "Uszkodzenie"], ["late", "Opóźnienie"]]},
                          {"id": "urgent", "type": "noul", "instructions": "Is it urgent?",
                           "options": [["true", "Yes"], ["false", "No"]]}],
            "answers": {"kind": {"type": "choice", "choice": "damage",
                                 "probabilities": {"damage": 0.97, "late": 0.03}, "confidence": 0.97},
                        "urgent": {"type": "noul", "noul": 0.3}}}


class CannedSource:
    """A Source for DashboardApp: the snapshot, then the events, then silence (or a disconnect)."""

    url = "http://127.0.0.1:8000"

    def __init__(self, events: list[dict[str, Any]] | None = None, connected: bool = True,
                 stats: dict[str, Any] | None = None) -> None:
        self.events = canned_events() if events is None else events
        self.stats = STATS if stats is None else stats
        self.connected = connected
        self.asked: list[str] = []

    async def run(self, sink) -> None:
        if not self.connected:
            sink.daemon_connection(False, "connection refused (is the daemon running?)")
        else:
            sink.daemon_stats(copy.deepcopy(self.stats))
            sink.daemon_connection(True)
            for event in self.events:
                sink.daemon_event(copy.deepcopy(event))
        await asyncio.Event().wait()

    async def request(self, request_id: str) -> dict[str, Any] | None:
        self.asked.append(request_id)
        return detail(request_id)


def screen_text(app) -> str:
    """What the terminal shows now, as plain text (the same render as Textual's SVG screenshots)."""
    import io

    from rich.console import Console

    width, height = app.size
    console = Console(width=width, height=height, file=io.StringIO(), force_terminal=True, color_system="truecolor",
                      record=True, legacy_windows=False, safe_box=False)
    console.print(app.screen._compositor.render_update(full=True, screen_stack=app._background_screens))
    return console.export_text(styles=False)


@pytest.fixture(autouse=True)
def utc(monkeypatch):
    """The dashboard prints local times: the tests read them in UTC (import this fixture into a test module)."""
    monkeypatch.setenv("TZ", "UTC")
    time.tzset()
    yield
    monkeypatch.undo()
    time.tzset()

"""The state cache's figures (engine/prefix_cache.py), side by side in one run.

`basal-local bench --cache`: in process, a long document with five questions and then five other questions about
it, on an engine whose cache holds only the templates (what the daemon did before the state cache) and on one with
the cache on, documents one after another, alternating which engine goes first. Reports both times, their ratios
and whether the answers with a hit are bitwise those without one.

`basal-local bench --http URL --documents N`: a mixed stream over HTTP: N documents, `--per-document` requests
each (two questions drawn from a pool), in a seeded random order, from `--clients` clients; throughput, latency
percentiles, the share of requests that read their document from the cache (x-basal-cached-tokens) and the
daemon's cache counters and peak memory from /api/stats. Run it against a daemon with `--prefix-cache off` and
one with the cache on, on the same machine, for the side by side.
"""

from __future__ import annotations

import gc
import http.client
import json
import random
import statistics
import threading
import time
import urllib.parse
from importlib import resources
from typing import Any

from . import UserError, auth_headers, get_json
from .benchout import answer_timings

# five other questions about the long document of the long-document bench (bench.LONG_DOC_QUESTIONS)
OTHER_QUESTIONS = {
    "notice": {"type": "choice", "instructions": "How long is the notice period for termination?",
               "criteria": {"one": "One month", "three": "Three months", "six": "Six months",
                            "none": "The contract does not say"}},
    "exclusive": {"type": "noul", "instructions": "Is the Supplier the Customer's exclusive provider?"},
    "fees": {"type": "score", "instructions": "How high are the fees compared with the market?",
             "criteria": ["much lower", "lower", "about the same", "higher", "much higher"]},
    "court": {"type": "choice", "instructions": "Where are disputes decided?",
              "criteria": {"warsaw": "Courts in Warsaw", "london": "Courts in London",
                           "arbitration": "An arbitration court", "other": "Elsewhere"}},
    "data": {"type": "noul", "instructions": "May the Supplier process the Customer's personal data?"},
}


def _median(values: list[float]) -> float:
    return round(statistics.median(values), 2)


def bench_cache(model_dir, device: str, dtype: str, doc_tokens: int = 17800, documents: int = 3,
                gpu_memory: str | None = None, torch_options=None, progress=print, backend_name: str = "torch",
                attention: str = "auto") -> dict[str, Any]:
    """In process: templates-only engine vs cached engine on the same requests (see the module docstring)."""
    # the engine, the backends and torch: only for the in-process cache bench (`bench --http --documents`, the
    # other function of this module, needs none of them)
    import numpy as np

    from basal_local.backends.select import make_backend

    from ..api.answers import response_body
    from ..api.systemone import validate_systemone
    from ..engine import prefix_cache
    from ..engine.engine import EngineSettings, ModelEngine, freeze_heap
    from ..engine.gate import DeviceGate
    from ..model.directory import load_model_dir
    from ..telemetry import Telemetry
    from .benchengine import LONG_DOC_QUESTIONS, long_document, templates_only

    model = load_model_dir(model_dir)
    clipped = doc_tokens + 700 > model.config.max_position_embeddings  # room for the template and the questions
    if clipped:
        doc_tokens = model.config.max_position_embeddings - 700
    base = long_document(model.tokenizer, doc_tokens)
    state_tokens = len(model.tokenizer.encode(base))
    if clipped:  # the count the document has, not the one asked for (its last clause goes past it)
        progress(f"{model.name} holds {model.config.max_position_embeddings} positions: a document of "
                 f"{state_tokens} tokens")

    def engine(only: bool) -> ModelEngine:
        try:
            backend = make_backend(backend_name, device, attention, memory_limit=gpu_memory,
                                   torch_options=torch_options)
            backend.load(model.path, dtype)
        except ValueError as exc:  # a dtype it cannot run, weights over --gpu-memory: the user's error
            raise UserError(f"cannot load {model.name} on {device}: {exc}") from None
        # templates only: a pool with room for the templates and nothing more (no batch can store a document)
        cache = templates_only(model, backend) if only else "auto"
        e = ModelEngine(model, backend, DeviceGate(), Telemetry(), EngineSettings(prefix_cache=cache))
        e.start()
        return e

    progress("loading the engine that caches only the templates")
    before = engine(True)
    progress("loading the engine with the state cache")
    cached = engine(False)
    freeze_heap()  # as the daemon does once loaded: a full collection walking torch's objects is not a request's time

    def run(e: ModelEngine, state: str, questions: dict) -> tuple[float, list[float], Any]:
        request = validate_systemone({"model": model.name, "state": state, "questions": questions}, model.name)
        t = time.perf_counter()
        outcome = e.submit(e.plan(request)).result(600)
        ms = (time.perf_counter() - t) * 1000.0
        answers = response_body(outcome, "systemone", 0.0)["answers"]
        probs = [p for key in sorted(answers) for p in
                 (answers[key]["probabilities"].values() if "probabilities" in answers[key]
                  else [answers[key].get("noul", answers[key].get("score", 0.0))])]
        return ms, probs, outcome

    rows = []
    try:
        run(before, "Warm-up. " + base[:2000], LONG_DOC_QUESTIONS)
        run(cached, "Warm-up. " + base[:2000], LONG_DOC_QUESTIONS)
        for d in range(documents):
            state = f"Copy {d + 1} of the agreement.\n" + base
            progress(f"document {d + 1} of {documents}")
            first = [(before, "before"), (cached, "cached")][:: 1 if d % 2 == 0 else -1]
            times: dict[str, float] = {}
            probs: dict[str, list[float]] = {}
            for e, name in first:
                times[f"{name}_first_ms"], probs[f"{name}_first"], _ = run(e, state, LONG_DOC_QUESTIONS)
            for e, name in first[::-1]:
                times[f"{name}_second_ms"], probs[f"{name}_second"], outcome = run(e, state, OTHER_QUESTIONS)
                if name == "cached":
                    times["cached_tokens"] = outcome.cached_tokens
                    times["packed_tokens_second"] = outcome.packed_tokens
                    # where the hit's time went: planning (render, tokenize), queue (packing), device
                    times["cached_second_split_ms"] = {"planning": round(outcome.planning_ms, 2),
                                                       "queue": round(outcome.queue_ms, 2),
                                                       "compute": round(outcome.compute_ms, 2)}
            times["first_bitwise"] = probs["before_first"] == probs["cached_first"]
            times["second_bitwise"] = probs["before_second"] == probs["cached_second"]
            times["second_max_abs_diff"] = float(np.abs(np.array(probs["before_second"])
                                                        - np.array(probs["cached_second"])).max())
            # what storing a document costs, on one engine: a new document with the fills held back, then another
            # stored as usual (both computed in full)
            saved = prefix_cache.FILL_MIN_TOKENS
            prefix_cache.FILL_MIN_TOKENS = 1 << 30
            try:
                times["cached_engine_no_fill_ms"], _, _ = run(cached, f"Draft {d + 1}.\n" + base, LONG_DOC_QUESTIONS)
            finally:
                prefix_cache.FILL_MIN_TOKENS = saved
            times["cached_engine_fill_ms"], _, _ = run(cached, f"Version {d + 1}.\n" + base, LONG_DOC_QUESTIONS)
            rows.append(times)
        out = {"mode": "cache", "backend": cached.backend.name, "device": cached.backend.device, "state_tokens": state_tokens,
               "documents": documents, "per_document": rows,
               "first_ms": {"templates_only": _median([r["before_first_ms"] for r in rows]),
                            "cached": _median([r["cached_first_ms"] for r in rows])},
               "second_ms": {"templates_only": _median([r["before_second_ms"] for r in rows]),
                             "cached": _median([r["cached_second_ms"] for r in rows])},
               "bitwise_equal": sum(r["first_bitwise"] and r["second_bitwise"] for r in rows),
               "cache": cached.cache_snapshot(), "memory": cached.backend.memory()}
        out["first_ratio_cached_vs_templates_only"] = round(out["first_ms"]["cached"]
                                                            / out["first_ms"]["templates_only"], 3)
        out["fill_cost_ratio_same_engine"] = round(_median([r["cached_engine_fill_ms"] for r in rows])
                                                   / _median([r["cached_engine_no_fill_ms"] for r in rows]), 3)
        out["second_speedup"] = round(out["second_ms"]["templates_only"] / out["second_ms"]["cached"], 1)
        return out
    finally:
        before.stop(60)
        cached.stop(60)
        gc.unfreeze()  # what the engines held may go (a caller's process lives on: the tests')


# ---- the mixed stream over HTTP --------------------------------------------------------------------------------
QUESTION_POOL = [
    {"type": "noul", "instructions": "Is the customer asking for a refund?"},
    {"type": "noul", "instructions": "Is a payment overdue?"},
    {"type": "choice", "instructions": "What is the main topic?",
     "criteria": {"delivery": "Delivery", "payment": "Payment", "quality": "Quality", "other": None}},
    {"type": "score", "instructions": "How urgent is this?", "criteria": ["not", "a little", "quite", "very"]},
    {"type": "noul", "instructions": "Does the text name a deadline?"},
    {"type": "choice", "instructions": "Who wrote this?",
     "criteria": {"customer": "A customer", "supplier": "A supplier", "court": "A court", "other": None}},
    {"type": "noul", "instructions": "Is a contract mentioned?"},
    {"type": "noul", "instructions": "Is the tone hostile?"},
]


def documents_stream(model: str, documents: int, per_document: int, doc_chars: int, seed: int = 0) -> list[dict]:
    """The requests of the mixed stream: each document `per_document` times with two pool questions, shuffled."""
    corpus = resources.files("basal_local.assets").joinpath("corpus_en.txt").read_text(encoding="utf-8")
    words = corpus.split()
    rng = random.Random(seed)
    bodies = []
    for d in range(documents):
        start = rng.randrange(0, max(1, len(words) - 10))
        text, at = [f"Document {d + 1}."], start
        while sum(len(w) + 1 for w in text) < doc_chars:
            text.append(words[at % len(words)])
            at += 1
        state = " ".join(text)
        for _ in range(per_document):
            picked = rng.sample(range(len(QUESTION_POOL)), 2)
            bodies.append({"model": model, "state": state,
                           "questions": {f"q{i}": QUESTION_POOL[i] for i in picked}})
    rng.shuffle(bodies)
    return bodies


def bench_http_documents(url: str, clients: int, documents: int, per_document: int, doc_chars: int = 12000,
                         api_key: str | None = None, progress=None) -> dict[str, Any]:
    url = url.rstrip("/")
    model = get_json(url, "/v1/models", timeout=30, flag="--http", api_key=api_key)["models"][0]["name"]
    bodies = documents_stream(model, documents, per_document, doc_chars)
    before = get_json(url, "/api/stats", timeout=30, flag="--http", api_key=api_key)
    answered: list[tuple] = []  # (sent s, latency ms, queue ms, compute ms, batch requests, cached tokens)
    errors: list[str] = []
    lock = threading.Lock()
    queue = iter(range(len(bodies)))
    parts = urllib.parse.urlsplit(url)
    headers = {"Content-Type": "application/json", **auth_headers(api_key)}

    def client() -> None:
        conn = http.client.HTTPConnection(parts.hostname or "127.0.0.1", parts.port, timeout=600)
        while True:
            with lock:
                n = next(queue, None)
            if n is None:
                conn.close()
                return
            t = time.perf_counter()
            try:
                conn.request("POST", "/v1/systemone", json.dumps(bodies[n]).encode(), headers)
                resp = conn.getresponse()
                resp.read()
            except (OSError, http.client.HTTPException) as exc:
                conn.close()
                conn = http.client.HTTPConnection(parts.hostname or "127.0.0.1", parts.port, timeout=600)
                with lock:
                    errors.append(type(exc).__name__)
                continue
            with lock:
                if resp.status == 200:
                    answered.append((t - t0, (time.perf_counter() - t) * 1000.0, *answer_timings(resp.headers),
                                     int(resp.headers.get("x-basal-batch-requests", "1")),
                                     int(resp.headers.get("x-basal-cached-tokens", "0"))))
                else:
                    errors.append(f"HTTP {resp.status}")
                if progress is not None:
                    progress(len(answered) + len(errors), len(bodies))

    threads = [threading.Thread(target=client, daemon=True) for _ in range(clients)]
    t0 = time.perf_counter()
    for th in threads:
        th.start()
    for th in threads:
        while th.is_alive():
            th.join(timeout=0.2)
    elapsed = time.perf_counter() - t0
    after = get_json(url, "/api/stats", timeout=30, flag="--http", api_key=api_key)
    cache_before = (before.get("models") or [{}])[0].get("prefix_cache", {})
    cache_after = (after.get("models") or [{}])[0].get("prefix_cache", {})
    latencies, cached = [a[1] for a in answered], [a[5] for a in answered]
    template = min(cached) if cached else 0
    result: dict[str, Any] = {"mode": "http-documents", "url": url, "clients": clients, "documents": documents,
                              "per_document": per_document, "requests": len(latencies), "errors": len(errors)}
    if not latencies:
        result["error"] = "no request succeeded"
        return result
    ordered = sorted(latencies)

    def pct(q: float) -> float:
        return round(ordered[max(0, min(len(ordered) - 1, int(round(q * len(ordered) + 0.5)) - 1))], 2)

    result.update({
        "req_per_s": round(len(latencies) / elapsed, 2),
        "latency_ms": {"p50": pct(.5), "p95": pct(.95), "p99": pct(.99)},
        # a request read its document from the cache when it continued more than the template
        "document_hits": sum(c > template for c in cached), "hit_rate": round(sum(c > template for c in cached)
                                                                            / len(cached), 3),
        "cache": {key: cache_after.get(key, 0) - (cache_before.get(key, 0) if key in ("hits", "misses",
                                                                                    "hit_tokens", "evictions")
                                                  else 0)
                  for key in ("hits", "misses", "hit_tokens", "evictions", "bytes", "peak_bytes", "budget_bytes",
                              "nodes")},
        # the device's peak (every replica's own, as /api/stats lists them under its model): 0 on the CPU
        "peak_memory_bytes": max((r.get("memory", {}).get("device_peak_bytes", 0)
                                  for m in after.get("models", []) for r in m.get("replicas", [])), default=0)})
    # the slowest 1 % (2 at least) as the daemon timed them: first sights of a document that waited, or long batches?
    slowest = sorted(answered, key=lambda a: -a[1])[:max(2, len(answered) // 100)]
    result["slowest"] = [{"sent_s": round(a[0], 3), "latency_ms": round(a[1], 2), "queue_ms": a[2],
                          "compute_ms": a[3], "batch_requests": a[4], "document_hit": a[5] > template}
                         for a in sorted(slowest)]
    return result

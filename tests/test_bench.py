"""The in-process bench computes through the engine's own path (commands/benchengine.py): its batches are the
engine's batches, its answers are what the engine serves, and the logits it compares are the ones the engine read."""

from __future__ import annotations

import numpy as np
import pytest

from basal_local.commands.benchengine import Bench, bench_extras


@pytest.fixture(scope="module")
def bench(tiny_model):
    b = Bench(tiny_model, "torch", "cpu", "f32")
    yield b
    b.engine.stop()


def test_a_bench_batch_is_the_engines_batch_and_answers_as_the_engine_serves(bench):
    requests = bench.requests()[:3]
    before = bench.engine.batches
    flight = bench.decide(requests)
    assert bench.engine.batches == before + 1 and len(flight.jobs) == 3
    record = bench.engine.telemetry.snapshot()["batches"][-1]
    assert record["requests"] == 3
    assert record["forward"] == "eager" and record["device_ms"] is None  # how it ran (CUDA: graph, device time)
    alone = [bench.decide([r]).jobs[0].future.result().outcome for r in requests]
    bench.engine.start()  # the serving path: the lane thread and the Engine protocol's submit, one at a time
    for outcome, request in zip(alone, requests):  # (the CPU reference is exact per batch, not across batches)
        served = bench.engine.submit(bench.engine.plan(request)).result(timeout=60)
        assert {q: a.p_cal for q, a in outcome.answers.items()} == {q: a.p_cal for q, a in served.answers.items()}


def test_the_logits_are_one_array_per_prompt_with_its_letters(bench):
    request = bench.requests()[0]
    logits, flight = bench.logits([request])
    plan = flight.jobs[0].plan
    prompts = [qp for qp in plan.questions for _ in qp.token_ids]
    assert [len(x) for x in logits] == [len(qp.letter_ids) for qp in prompts]
    again, _ = bench.logits([request])
    assert all(np.array_equal(a, b) for a, b in zip(logits, again))


def test_the_extras_report_invariance_and_skip_documents_longer_than_the_context(tiny_model):
    out = bench_extras(tiny_model, "cpu", "f32", long_doc=True, invariance=1)
    inv = out["invariance_alone_vs_amid_31"]
    assert inv["trials"] == 1 and inv["bitwise_equal"] in (0, 1) and inv["max_abs_dlogit"] >= 0.0
    assert set(out) >= {"long_doc_4200", "long_doc_16500"}


def test_the_cache_bench_times_a_hit_that_changes_nothing(tiny_model):
    """`bench --cache`: the second request about a document reads it from the cache (it computes only its own
    tokens), answers within the CPU's 1e-6 of the engine without the cache, and the document is the length asked
    (within a clause), or what the model's positions hold, said so."""
    from basal_local.commands.benchcache import bench_cache

    said: list[str] = []
    out = bench_cache(tiny_model, "cpu", "f32", doc_tokens=1500, documents=1, progress=said.append)
    (row,) = out["per_document"]
    assert 1500 <= out["state_tokens"] < 1700  # within a clause or two (~100 tokens each)
    assert row["cached_tokens"] > out["state_tokens"] and row["packed_tokens_second"] < 0.5 * out["state_tokens"]
    assert row["second_max_abs_diff"] <= 1e-6 and out["second_ms"]["cached"] > 0
    assert not any("positions" in s for s in said)
    capped = bench_cache(tiny_model, "cpu", "f32", doc_tokens=10**6, documents=1, progress=said.append)
    assert capped["state_tokens"] <= 4096 - 500
    assert any(s.endswith(f"holds 4096 positions: a document of {capped['state_tokens']} tokens")
               for s in said)  # the count it has


def test_the_mixed_document_stream_reports_hits_and_the_peaks_against_the_budget(tiny_model):
    """`bench --http URL --documents N`: the requests that read their document from the cache, the cache's
    high-water mark within its budget, and the device's peak as the daemon's /api/stats lists it per replica
    (the CPU has none: a backend that reports one is given here)."""
    from basal_local.commands.benchcache import bench_http_documents

    from .conftest import InProcessDaemon

    d = InProcessDaemon([tiny_model], prefix_cache="64MB")
    d.wait_ready()
    try:
        backend = next(iter(d.state.engines.values())).backend
        own = backend.memory
        backend.memory = lambda: {**own(), "device_peak_bytes": 12345}
        out = bench_http_documents(d.url, clients=2, documents=2, per_document=3, doc_chars=1500)
    finally:
        d.stop()
    assert out["errors"] == 0 and out["requests"] == 6
    assert out["document_hits"] >= 1 and out["cache"]["hits"] >= out["document_hits"]
    cache = out["cache"]
    assert 0 < cache["bytes"] <= cache["peak_bytes"] <= cache["budget_bytes"] == 64_000_000
    assert out["peak_memory_bytes"] == 12345
    # the slowest as the daemon timed them: a document's first sight or a hit, its queue and compute
    slowest = out["slowest"]
    assert len(slowest) == 2 and all(s["latency_ms"] > 0 and s["compute_ms"] > 0 and s["queue_ms"] is not None
                                     and s["batch_requests"] >= 1 and isinstance(s["document_hit"], bool)
                                     for s in slowest)
    assert [s["sent_s"] for s in slowest] == sorted(s["sent_s"] for s in slowest)


def test_the_cache_bench_runs_the_backend_asked_for(tiny_model):
    """`bench --cache --backend mlx` measured torch and did not say so: the figures are now the MLX engine's, and
    the record names its backend."""
    pytest.importorskip("mlx.core")
    from basal_local.commands.benchcache import bench_cache

    out = bench_cache(tiny_model, "cpu", "f32", doc_tokens=1500, documents=1, progress=lambda _: None,
                      backend_name="mlx")
    (row,) = out["per_document"]
    assert out["backend"] == "mlx" and row["cached_tokens"] > out["state_tokens"]
    assert row["second_max_abs_diff"] <= 1e-6


def test_the_bench_table_opens_a_list_of_records_into_numbered_rows():
    """`bench --cache` printed per_document as one JSON blob folded across the table."""
    from basal_local.commands.benchout import flatten

    rows = dict(flatten({"per_document": [{"ms": 1.5, "split": {"compute": 1.0}}, {"ms": 2.0, "split": {}}],
                         "ids": [1, 2], "mode": "cache"}))
    assert rows == {"per_document.1.ms": "1.5", "per_document.1.split.compute": "1.0", "per_document.2.ms": "2.0",
                    "per_document.2.split": "{}", "ids": "[1, 2]", "mode": "cache"}

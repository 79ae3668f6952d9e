"""The cross-request state cache (engine/prefix_cache.py): the radix tree and its pool on their own, then through
real engines (torch f32 and MLX on the CPU) against engines without the cache, then over HTTP.

The reference for every answer is the same request on an engine with `--prefix-cache off` (which computes every
prompt in full, the templates included): on the CPU the library GEMMs may round differently at another row
count, so answers agree within 1e-6 there (bitwise on CUDA: tests/test_cuda.py)."""

from __future__ import annotations

import os
import random
import sys
import threading
import time
import urllib.request

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from basal_local.api.answers import response_body
from basal_local.api.systemone import validate_systemone
from basal_local.backends.base import Ready
from basal_local.backends.memory import WARM_OVERHEAD, budget_bytes
from basal_local.backends.torch import TorchBackend
from basal_local.engine.engine import EngineSettings, ModelEngine
from basal_local.engine.gate import DeviceGate
from basal_local.engine.prefix_cache import PrefixCache
from basal_local.model import load_model_dir
from basal_local.replicas.inprocess import ReplicaSet
from basal_local.settings import Settings
from basal_local.telemetry import Telemetry

from .conftest import Daemon, http

M = "basal-test-tiny"
WAIT = 120.0


# ---- the tree and the pool on their own ---------------------------------------------------------------------
def _cache(capacity: int = 1000) -> PrefixCache:
    return PrefixCache(capacity, bytes_per_token=10)


def _store(cache: PrefixCache, tokens: list[int]):
    lease = cache.lease()
    entry = lease.fill(tokens)
    lease.commit()
    return entry


def test_a_prompt_continues_the_longest_shared_run_of_any_entry_even_mid_way():
    cache = _cache()
    a = _store(cache, list(range(100)))
    b = _store(cache, list(range(50)) + [7] * 30)
    assert cache.match(list(range(100)) + [5]).entry is a and cache.match(list(range(100)) + [5]).length == 100
    m = cache.match(list(range(60)) + [9, 9])  # leaves a after 60 tokens: a's first 60 rows serve
    assert m.entry is a and m.length == 60
    m = cache.match(list(range(50)) + [7] * 10 + [1])  # the split edge: b's own branch
    assert m.entry is b and m.length == 60
    m = cache.match(list(range(50)) + [3])  # both share 50: either serves
    assert m.entry in (a, b) and m.length == 50
    assert cache.match([999, 1, 2]) is None
    # the last token is always computed: an identical prompt continues all but its last token
    assert cache.match(list(range(100))).length == 99
    name, used = cache.split(list(range(30)) + [4])
    assert name in (a.name, b.name) and used == 30


def test_lookups_find_only_published_entries_and_a_failed_batch_leaves_nothing():
    cache = _cache()
    lease = cache.lease()
    entry = lease.fill(list(range(40)))
    assert entry is not None and cache.match(list(range(41))) is None  # being computed: not yet findable
    assert cache.lease().fill(list(range(40))) is None  # the same tokens are not stored twice
    lease.abort()
    assert cache.match(list(range(41))) is None and cache.snapshot()["tokens"] == 0
    assert cache.free == [(0, 1000)]


def test_eviction_takes_the_least_recently_used_idle_entry_never_one_in_use_or_pinned():
    cache = _cache(capacity=300)
    template = cache.pin("en", list(range(1000, 1050)))
    cache.publish(template)
    a = _store(cache, [1] * 100)
    b = _store(cache, [2] * 100)
    reader = cache.lease()
    reader.use(a.name)  # a batch reads a: a is newer than b now and held
    c = _store(cache, [3] * 100)  # needs room: b is the idle, least recently used one
    assert c is not None and b.name not in cache.entries and a.name in cache.entries
    assert cache.stats["evictions"] == 1
    # a held and the template pinned: even without c no run of 200 rows; nothing is evicted for nothing
    assert cache.lease().fill([4] * 200) is None and c.name in cache.entries
    reader.commit()
    d = _store(cache, [4] * 200)  # now a is idle and older than c: a goes, then c
    assert d is not None and "en" in cache.entries and a.name not in cache.entries
    assert sum(e.length for e in cache.entries.values()) <= cache.capacity


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(st.integers(0, 5), st.integers(1, 120), st.booleans()), min_size=1, max_size=40))
def test_random_streams_keep_the_pool_consistent(ops):
    """Whatever is stored, read and dropped: entries never overlap, never exceed the capacity, free runs and
    entries tile the pool exactly, and every lookup returns a prefix the entry really holds."""
    cache = _cache(capacity=400)
    held = []
    for doc, length, hold in ops:
        tokens = [doc * 1000 + i for i in range(length)]
        lease = cache.lease()
        m = cache.match(tokens + [7])
        if m is not None:
            assert m.entry.tokens[:m.length] == tokens[:m.length]
            lease.use(m.entry.name)
        lease.fill(tokens)
        if hold:
            held.append(lease)
        else:
            lease.commit()
        if len(held) > 2:
            held.pop(0).commit()
        runs = sorted([(e.offset, e.length) for e in cache.entries.values()] + cache.free)
        at = 0
        for start, n in runs:
            assert start == at and n > 0
            at += n
        assert at == cache.capacity


def test_budget_forms():
    gpu = (80_000_000_000, 141_000_000_000)
    assert budget_bytes("off", gpu) == 0
    assert budget_bytes("8GB", gpu) == 8_000_000_000
    assert budget_bytes("25%", gpu) == 20_000_000_000
    assert budget_bytes(0.5, None, ram=16 * 2 ** 30) == 8 * 2 ** 30
    assert 0.5 * 80e9 < budget_bytes("auto", gpu) < 80e9  # most of a large GPU's free memory
    assert budget_bytes("auto", (20e9, 24e9)) < 0.3 * 20e9  # less of a small one
    assert budget_bytes("auto", None, ram=16 * 2 ** 30) < 2 ** 30  # little on a 16 GB Mac
    for bad in ("lots", "-1GB", "0", "120%"):
        with pytest.raises(ValueError, match="--prefix-cache"):
            budget_bytes(bad, gpu)
    # more than there is: one sentence naming the room, not an allocator's failure after `serving on`
    with pytest.raises(ValueError, match="--prefix-cache 5TB: more than the 80.0 GB the GPU has free"):
        budget_bytes("5TB", gpu)
    with pytest.raises(ValueError, match="more than the 17.2 GB this machine has available"):
        budget_bytes("20GB", None, ram=16 * 2 ** 30)
    with pytest.raises(ValueError, match="must be more than 0; .*, or off to keep nothing"):
        budget_bytes("0", gpu)
    # without a GPU every replica's pool is planned against the same RAM: all of them must fit it
    assert budget_bytes("6GB", None, ram=16 * 2 ** 30, replicas=2) == 6_000_000_000
    with pytest.raises(ValueError, match="more than the 17.2 GB this machine has available for 3 replicas"):
        budget_bytes("6GB", None, ram=16 * 2 ** 30, replicas=3)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="MemAvailable is Linux's")
def test_a_share_without_a_gpu_is_of_the_memory_available_not_of_all_of_it():
    """`--prefix-cache 1` on the CPU planned with all of the RAM (MemTotal), nothing left for the weights, the OS
    or anything else: it is now a share of what the system has available."""
    from basal_local.backends.memory import available_ram

    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    with open("/proc/meminfo") as fh:
        meminfo = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in fh}
    assert 0 < budget_bytes(1.0, None) < total
    assert abs(budget_bytes(0.5, None) - 0.5 * meminfo["MemAvailable"]) < 0.05 * total
    assert abs(available_ram() - meminfo["MemAvailable"]) < 0.05 * total


def test_replicas_on_one_gpu_get_equal_caches_whichever_opens_first():
    """Two replicas of a 9.5 GB model on a 141 GB GPU, loading side by side: the one that opens its pool second
    (after the first's weights and pool) gets what the first got, as does one that opens at the same moment;
    together they stay within the GPU; another program's memory still caps them."""
    total, weights = 141e9, 9.5e9
    first = budget_bytes("auto", (total - weights, total), replicas=2, weights=weights)
    at_once = budget_bytes("auto", (total - 2 * weights, total), replicas=2, weights=weights)
    after = budget_bytes("auto", (total - 2 * weights - first, total), replicas=2, weights=weights)
    assert first == at_once == after > 0.3 * (total - 2 * weights) * 0.6
    assert 2 * (first + weights + WARM_OVERHEAD) <= total
    alone = budget_bytes("auto", (total - weights, total))  # one replica keeps 60 % of what is free
    assert alone == int((total - weights - WARM_OVERHEAD) * 0.6) > first
    crowded = budget_bytes("auto", (30e9, total), replicas=2, weights=weights)  # another program holds most
    assert crowded == int((30e9 - WARM_OVERHEAD) * 0.6)
    # a share likewise: of each replica's equal part (the second saw only what the first's pool left)
    first = budget_bytes("0.5", (total - weights, total), replicas=2, weights=weights)
    after = budget_bytes("0.5", (total - 2 * weights - first, total), replicas=2, weights=weights)
    assert first == after == int(0.5 * (total - 2 * (weights + WARM_OVERHEAD)) / 2)
    assert budget_bytes("0.5", (total - weights, total)) == int(0.5 * (total - weights))  # one replica: of all


def test_an_engine_splits_its_gpu_with_the_other_replicas_on_it(tiny_model, monkeypatch):
    """The engine hands budget_bytes how many replicas share its device (9 GB GPU, 5 GB free: a replica alone
    takes a quarter of what is free after the warm-up's reserve, one of two a quarter of its half of the GPU)."""
    capacities = []
    for replicas in (1, 2):
        backend = TorchBackend(device="cpu")
        backend.load(tiny_model, "f32")
        monkeypatch.setattr(backend, "device_memory", lambda: (5e9, 9e9))
        engine = ModelEngine(load_model_dir(tiny_model), backend, DeviceGate(), Telemetry(), EngineSettings(),
                             device_replicas=replicas)
        weights = backend.memory()["weights_bytes"]
        want = budget_bytes("auto", (5e9, 9e9), replicas=replicas, weights=weights) // backend.kv_bytes_per_token()
        capacities.append(engine.cache.capacity)
        assert engine.cache.capacity == want
        engine.stop(30)
        del engine, backend
    assert capacities[1] < capacities[0]


def test_the_setting_is_checked_where_it_is_read(tmp_path):
    assert Settings.load({"prefix_cache": "2GB"}).engine.prefix_cache == "2GB"
    with pytest.raises(ValueError, match="prefix_cache = 'plenty'"):
        Settings.load({"prefix_cache": "plenty"})
    config = tmp_path / "config.toml"
    config.write_text("prefix_cache = 0.25\n")
    assert Settings.load({}, config).engine.prefix_cache == 0.25


# ---- through engines -------------------------------------------------------------------------------------------
def document(seed: int, words: int = 220) -> str:
    rng = random.Random(seed)
    vocab = ["the", "parcel", "invoice", "arrived", "late", "broken", "contract", "payment", "was", "sent", "on",
             "Monday", "customer", "asks", "for", "a", "refund", "because", "of", "damage", "delay", "and"]
    return " ".join(rng.choice(vocab) for _ in range(words)) + "."


def body(doc: str, variant: int) -> dict:
    return {"model": M, "state": doc,
            "questions": {f"q{variant}": {"type": "choice", "instructions": f"Which problem, reading {variant}?",
                                          "criteria": {"a": "Damage", "b": "Delay", "c": None}},
                          f"n{variant}": {"type": "noul", "instructions": f"Is it urgent (check {variant})?"}}}


def probs(answers: dict) -> np.ndarray:
    out = []
    for key in sorted(answers):
        a = answers[key]
        out.extend(a["probabilities"].values() if "probabilities" in a else [a["noul"]])
    return np.array(out, dtype=np.float64)


def make_engine(model_dir, cache: str = "auto", backend: str = "torch", wrap=None, **kw) -> ModelEngine:
    """A started engine on the CPU; `wrap`: a class the loaded backend is handed to (a backend that holds or
    times its forwards), the engine's backend then."""
    if backend == "mlx":
        from basal_local.backends.mlx import MLXBackend

        b = MLXBackend(device="cpu")
    else:
        b = TorchBackend(device="cpu")
    b.load(model_dir, "f32")
    if wrap is not None:
        b = wrap(b)
    engine = ModelEngine(load_model_dir(model_dir), b, DeviceGate(), Telemetry(),
                         EngineSettings(long_tokens=kw.pop("long_tokens", 0), prefix_cache=cache, **kw))
    engine.start()
    return engine


def ask(engine, payload: dict):
    outcome = engine.submit(engine.plan(validate_systemone(payload, M))).result(WAIT)
    return probs(response_body(outcome, "systemone", 0.0)["answers"]), outcome


@pytest.fixture(scope="module")
def reference(tiny_model):
    engine = make_engine(tiny_model, cache="off")
    yield engine
    engine.stop(WAIT)


@pytest.mark.parametrize("backend", ["torch", "mlx"])
def test_a_new_question_about_a_known_document_computes_only_its_own_tokens(tiny_model, reference, backend):
    if backend == "mlx":
        pytest.importorskip("mlx.core")
    engine = make_engine(tiny_model, backend=backend)
    try:
        doc = document(1)
        first_p, first = ask(engine, body(doc, 1))
        second_p, second = ask(engine, body(doc, 2))
        want1, _ = ask(reference, body(doc, 1))
        want2, full = ask(reference, body(doc, 2))
        assert np.abs(first_p - want1).max() <= 1e-6 and np.abs(second_p - want2).max() <= 1e-6
        snap = engine.cache_snapshot()
        assert snap["hits"] == 1 and snap["misses"] == 1 and snap["nodes"] == 3  # two templates and the document
        template = len(engine.model.tokenizer.template_prefix("en"))
        assert first.cached_tokens == template  # the first time only the template was cached
        assert second.cached_tokens > template + 200  # the document came from the cache
        assert second.packed_tokens < full.packed_tokens - 200  # and was not computed again
        assert snap["hit_tokens"] == second.cached_tokens
        assert snap["bytes"] == snap["tokens"] * engine.backend.kv_bytes_per_token()
    finally:
        engine.stop(WAIT)


def test_a_small_budget_evicts_and_every_answer_stays_the_reference(tiny_model, reference):
    per_token = reference.backend.kv_bytes_per_token()
    tok = reference.model.tokenizer
    templates = sum(len(tok.template_prefix(lang)) for lang in ("pl", "en"))
    doc = len(reference.plan(validate_systemone(body(document(10), 0), M)).questions[0].token_ids[0])
    # room for the templates and about one and a half documents
    engine = make_engine(tiny_model, cache=f"{(templates + 1.5 * doc) * per_token / 1e6}MB")
    try:
        docs = [document(10 + i) for i in range(3)]
        for round_ in range(2):
            for i, doc in enumerate(docs):
                got, _ = ask(engine, body(doc, round_ * 3 + i))
                want, _ = ask(reference, body(doc, round_ * 3 + i))
                assert np.abs(got - want).max() <= 1e-6
                snap = engine.cache_snapshot()
                assert snap["tokens"] <= snap["capacity_tokens"]
        assert engine.cache_snapshot()["evictions"] >= 3
    finally:
        engine.stop(WAIT)


class _Held:
    """A torch backend whose forwards wait for a release (to queue requests behind a batch)."""

    def __init__(self, backend):
        self.backend, self.gate = backend, threading.Event()
        self.fills = 0

    def __getattr__(self, name):
        return getattr(self.backend, name)

    def forward(self, batch):
        self.gate.wait(WAIT)
        self.fills += len(batch.fills)
        return self.backend.forward(batch)

    def launch(self, batch):
        return Ready(self.forward(batch))

    def forward_steps(self, batch):
        self.gate.wait(WAIT)
        self.fills += len(batch.fills)
        yield from self.backend.forward_steps(batch)


def test_the_same_new_document_arriving_at_once_is_computed_once(tiny_model, reference):
    engine = make_engine(tiny_model, wrap=_Held)
    held = engine.backend
    try:
        doc = document(30)
        blocker = engine.submit(engine.plan(validate_systemone(body(document(31), 0), M)))
        futures = [engine.submit(engine.plan(validate_systemone(body(doc, v), M))) for v in range(4)]
        held.gate.set()
        blocker.result(WAIT)
        outcomes = [f.result(WAIT) for f in futures]
        assert held.fills == 2  # the blocker's document and this one, once
        for v, outcome in enumerate(outcomes):
            want, _ = ask(reference, body(doc, v))
            assert np.abs(probs(response_body(outcome, "systemone", 0.0)["answers"]) - want).max() <= 1e-6
    finally:
        engine.stop(WAIT)


def test_a_document_too_short_to_be_worth_a_pool_row_is_not_stored(tiny_model):
    engine = make_engine(tiny_model)
    try:
        ask(engine, body("A short note.", 1))
        assert engine.cache_snapshot()["nodes"] == 2  # the templates only
    finally:
        engine.stop(WAIT)


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                HealthCheck.function_scoped_fixture])
@given(st.lists(st.tuples(st.integers(0, 3), st.integers(0, 5)), min_size=3, max_size=8))
def test_random_request_streams_answer_as_without_the_cache(tiny_model, reference, stream):
    """Random documents (some a longer version of another) and questions through one cached engine with a
    small pool, each answer against the uncached reference."""
    engine = make_engine(tiny_model, cache=f"{2_000 * reference.backend.kv_bytes_per_token() / 1e6}MB")
    try:
        base = [document(40 + d) for d in range(3)]
        docs = base + [base[0] + " " + document(50)]  # document 3 extends document 0
        for d, v in stream:
            got, _ = ask(engine, body(docs[d], v))
            want, _ = ask(reference, body(docs[d], v))
            assert np.abs(got - want).max() <= 1e-6
    finally:
        engine.stop(WAIT)


def test_replicas_route_a_request_to_the_replica_holding_its_document(tiny_model):
    engines = [make_engine(tiny_model) for _ in range(2)]
    for r, e in enumerate(engines):
        e.replica = r
    replicas = ReplicaSet(engines)
    try:
        doc = document(60)
        plan = engines[1].plan(validate_systemone(body(doc, 0), M))
        engines[1].submit(plan).result(WAIT)  # replica 1 holds the document now
        for v in range(1, 4):
            replicas.submit(replicas.plan(validate_systemone(body(doc, v), M))).result(WAIT)
        assert engines[1].cache_snapshot()["hits"] == 3 and engines[0].batches == 0
        # a new document goes to the replica with less work (a tie: the first)
        replicas.submit(replicas.plan(validate_systemone(body(document(61), 0), M))).result(WAIT)
        assert engines[0].batches == 1
    finally:
        replicas.stop(WAIT)


def test_off_keeps_nothing_and_answers_the_same(tiny_model, reference):
    engine = make_engine(tiny_model, cache="off")
    try:
        _, outcome = ask(engine, body(document(2), 1))
        assert outcome.cached_tokens == 0 and engine.cache_snapshot()["nodes"] == 0
    finally:
        engine.stop(WAIT)


# ---- over HTTP -----------------------------------------------------------------------------------------------
def test_the_daemon_reports_the_cache_in_headers_stats_and_metrics(tiny_model):
    daemon = Daemon(["--model", str(tiny_model), "--device", "cpu", "--metrics", "--prefix-cache", "64MB"])
    try:
        daemon.wait_ready(timeout=240)
        doc = document(70)
        status, headers, _ = http("POST", daemon.url + "/v1/systemone", body(doc, 1))
        assert status == 200
        status, headers, _ = http("POST", daemon.url + "/v1/systemone", body(doc, 2))
        assert status == 200 and int(headers["x-basal-cached-tokens"]) > 200
        _, _, stats = http("GET", daemon.url + "/api/stats")
        cache = stats["models"][0]["prefix_cache"]
        assert cache["enabled"] and cache["setting"] == "64MB" and cache["hits"] == 1 and cache["nodes"] == 3
        assert cache["budget_bytes"] <= 64_000_000 + cache["capacity_tokens"] and cache["bytes"] > 0
        tree = stats["batches"][-1]["tree"]
        assert any(row["cache_hit"] and row["cached_tokens"] > 200 for row in tree)
        with urllib.request.urlopen(daemon.url + "/metrics", timeout=30) as resp:
            text = resp.read().decode()
        assert 'basal_prefix_cache_hits_total{model="basal-test-tiny",replica="0"} 1.0' in text
        # counters as Prometheus types them (rate() warns on a `_total` gauge); memory figures are gauges
        for name in ("hits", "misses", "hit_tokens", "evictions"):
            assert f"# TYPE basal_prefix_cache_{name}_total counter" in text
        assert "# TYPE basal_prefix_cache_peak_bytes gauge" in text and cache["peak_bytes"] >= cache["bytes"]
    finally:
        daemon.stop()


def test_a_bad_prefix_cache_value_is_one_sentence(tiny_model):
    from .test_cli import cli

    run = cli("serve", "--model", str(tiny_model), "--prefix-cache", "plenty")
    assert run.returncode == 2 and "--prefix-cache 'plenty': not a memory size" in run.stderr
    assert "Traceback" not in run.stdout + run.stderr
    # on the CPU a size over the memory the machine has available is refused before the banner, not while loading
    run = cli("serve", "--model", str(tiny_model), "--device", "cpu", "--prefix-cache", "5000TB", "--port", "0")
    assert run.returncode == 2 and "--prefix-cache 5000TB: more than the" in run.stderr, run.stderr
    assert "serving" not in run.stdout


def test_a_known_documents_text_is_not_tokenized_again(tiny_model):
    """The tokenizer remembers the ids of long shared texts: the second request about a document tokenizes only
    its own questions, and every prompt's ids are still exactly `encode` of the prompt."""
    tok = load_model_dir(tiny_model).tokenizer
    doc = document(90, words=600)
    prompts = [f"<s>{doc} question {q}: which? A or B" for q in range(3)]
    seen: list[int] = []
    run = tok._run
    tok._run = lambda texts: seen.append(sum(len(t) for t in texts)) or run(texts)
    try:
        first = tok.encode_batch(prompts, remember=len("<s>") + len(doc))
        again = tok.encode_batch([f"<s>{doc} question {q}: which? A or B" for q in range(3, 6)])
    finally:
        tok._run = run
    assert first == [tok.encode(p) for p in prompts]
    assert again == [tok.encode(f"<s>{doc} question {q}: which? A or B") for q in range(3, 6)]
    assert sum(seen[:-1]) > len(doc) and seen[-1] < 200  # the second time only the questions' text
    one = tok.encode_batch([f"<s>{doc} another question? A or B"])  # one prompt starting with the kept text
    assert one == [tok.encode(f"<s>{doc} another question? A or B")]


def test_a_known_document_before_new_tails_is_neither_tokenized_nor_copied_again(tiny_model):
    """`encode_after(head, tails)`: ids exactly `encode(head + tail)`, the first time and again with other tails;
    the second time only the tails and the head's last words reach the tokenizer. Tails that share a leading
    space make the whole head the kept text; tails without a space after it cannot continue it."""
    tok = load_model_dir(tiny_model).tokenizer
    seen: list[int] = []
    run = tok._run
    tok._run = lambda texts: seen.append(max(len(t) for t in texts)) or run(texts)
    try:
        for doc, tails in ((91, [f" question {q}: which? A or B" for q in range(2)]),
                           (92, [f" question {q}: which?" for q in range(2)] + [f"\n\nPytanie {q}: zażółć?"
                                                                                for q in range(2)])):
            head = "<s>" + document(doc, words=600)
            first, shared = tok.encode_after(head, tails, remember=len(head))
            assert first == [tok.encode(head + t) for t in tails] and shared > 0
            for others, known in (([f" other {q}?" for q in range(3)], True), ([" one more?"], True),
                                  ([f"\nOther {q}?" for q in range(3)], doc == 92)):
                seen.clear()
                again, shared = tok.encode_after(head, others)
                assert again == [tok.encode(head + t) for t in others]
                assert all(a[:shared] == again[0][:shared] for a in again)
                assert (max(seen) < 200) == known  # known: the tails and the head's last words, not the document
    finally:
        tok._run = run
    tok._splits = False  # a vocabulary without exact cuts: every prompt whole, the same ids
    try:
        assert tok.encode_after(head, tails)[0] == [tok.encode(head + t) for t in tails]
    finally:
        tok._splits = True


def test_worker_processes_route_a_request_to_the_worker_that_was_sent_its_document(tiny_model):
    """Two documents at once go to the two workers (the second finds the first busy); the next question about
    each goes back to the worker that computed it, where routing by queued tokens alone would send both to
    worker 0 (both idle). The batch records say which worker answered."""
    from concurrent.futures import ThreadPoolExecutor

    d = Daemon(["--model", str(tiny_model), "--device", "cpu", "--replicas", "2", "--replica-processes"])
    try:
        d.wait_ready(timeout=240)
        docs = [document(100), document(101)]
        with ThreadPoolExecutor(2) as pool:
            first = list(pool.map(lambda doc: http("POST", d.url + "/v1/systemone", body(doc, 1)), docs))
        assert [status for status, _, _ in first] == [200, 200]
        _, _, stats = http("GET", d.url + "/api/stats")
        by_request = {rid: b["replica"] for b in stats["batches"] for rid in b["request_ids"]}
        owner = [by_request[headers["x-request-id"]] for _, headers, _ in first]
        assert sorted(owner) == [0, 1], owner  # one document on each worker
        for doc, worker in zip(docs, owner):
            status, headers, _ = http("POST", d.url + "/v1/systemone", body(doc, 2))
            assert status == 200 and int(headers["x-basal-cached-tokens"]) > 250  # the worker's cache had it
            _, _, stats = http("GET", d.url + "/api/stats")
            by_request = {rid: b["replica"] for b in stats["batches"] for rid in b["request_ids"]}
            assert by_request[headers["x-request-id"]] == worker
    finally:
        d.stop()


def test_a_worker_holding_documents_is_charged_only_their_questions(monkeypatch):
    """The front charges a worker's queue what a request costs there: a question about a document the worker was
    sent adds its own tokens, not the document's. Charged the whole document, a worker answering three questions
    about its documents looked 3 documents busy, and the fourth question went to the idle worker, which computed
    the document again (`tools/routing.py`: hit rate 0.695 as least-queued routing's 0.70)."""
    import collections
    from concurrent.futures import Future
    from types import SimpleNamespace

    from basal_local.replicas.front import ProcessReplicaSet
    from basal_local.replicas.remote import Pending

    template = list(range(90000, 90060))  # cached on every worker: neither in a request's tokens nor saved
    docs = [template + list(range(1000 * k, 1000 * k + 3000)) for k in range(4)]

    def worker(n):
        return SimpleNamespace(replica=n, queued=0, pending={}, alive=True, documents=collections.deque(maxlen=64),
                               send=lambda message: True)

    front = object.__new__(ProcessReplicaSet)
    holder, idle = worker(0), worker(1)
    front._lock, front.stopping = threading.Lock(), False
    monkeypatch.setattr(front, "live", lambda: [holder, idle])
    holder.documents.extend(docs)  # it answered a question about each before
    sent = []
    for k, doc in enumerate(docs):  # a question about each, none answered yet
        pending = Pending(k, None, Future(), lambda: False, tokens=3000 + 30, arrival=0.0, shared=doc,
                          template=len(template))
        front._dispatch(pending)
        sent.append(0 if k in holder.pending else 1)
    # each charged its 30 tokens of questions (fewer than the template: charged the template off too, it was 0)
    assert sent == [0, 0, 0, 0] and holder.queued == 4 * 30 and idle.queued == 0
    assert front._take(holder, 2).charged == 30 and holder.queued == 3 * 30  # answered: its charge comes off
    # a new document goes where the queue is shorter, charged whole
    new = Pending(9, None, Future(), lambda: False, tokens=3030, arrival=0.0,
                  shared=template + list(range(50000, 53000)), template=len(template))
    front._dispatch(new)
    assert 9 in idle.pending and idle.queued == 3030


def test_two_fills_of_one_forward_keeping_the_same_tokens_both_get_their_kv(tiny_model):
    """A token two fills of a batch keep (one request's state, another's state and more) is stored by RoPE in
    the first fill's row and copied to the second's after the forward: both entries then hold the K/V a
    forward of the prefix alone computes."""
    from basal_local.backends.base import Fill, PackedBatch

    b = TorchBackend(device="cpu")
    b.load(tiny_model, "f32")
    b.open_cache(64)
    ids = list(range(5, 25))
    batch = PackedBatch.single(ids)
    batch.fills = [Fill("a", 0, None, 0, np.arange(12)), Fill("b", 20, None, 0, np.arange(20))]
    for _ in b.forward_steps(batch):
        pass
    fwd = b.fwd
    alone = PackedBatch.single(ids)
    alone.fills = [Fill("c", 40, None, 0, np.arange(20))]
    for _ in b.forward_steps(alone):
        pass
    for pool in (*fwd.prefix_k, *fwd.prefix_v):
        assert torch.equal(pool[20:40], pool[40:60])  # "b" whole: 12 rows copied from "a", 8 stored by RoPE
        assert torch.equal(pool[0:12], pool[40:52])


class _Pipelined:
    """A torch backend whose launches return before their logits exist (as CUDA's do), each reporting
    DEVICE_S of device time, so a lane forms its next batch while one is in flight; closing `gate` holds
    every launched forward unfinished."""

    DEVICE_S = 0.05

    def __init__(self, backend):
        self.backend, self.gate, self.launched = backend, threading.Event(), threading.Event()
        self.gate.set()

    def __getattr__(self, name):
        return getattr(self.backend, name)

    def launch(self, batch):
        self.launched.set()
        outer = self

        class Handle:
            def done(self):
                return outer.gate.is_set()

            def result(self):
                outer.gate.wait(WAIT)
                return outer.backend.forward(batch)

            def device_s(self):
                return outer.DEVICE_S

        return Handle()


def test_a_request_about_a_document_a_batch_in_flight_is_storing_waits_for_it(tiny_model, reference):
    """Two requests about one new document, the second formed into a batch while the first's batch is still
    on the device: the second waits for that batch and continues the document from the cache (a hit) instead
    of computing it again beside it; its answers are the reference's."""
    engine = make_engine(tiny_model, wrap=_Pipelined)
    pipe = engine.backend
    try:
        for seed in (40, 41):  # the lane learns the device time of batches this size: the next ones overlap
            ask(engine, body(document(seed), 0))
        doc = document(42)
        hits = engine.cache_snapshot()["hits"]
        pipe.gate.clear()
        pipe.launched.clear()
        first = engine.submit(engine.plan(validate_systemone(body(doc, 1), M)))
        assert pipe.launched.wait(WAIT)  # the first request's batch is on the device, its document pending
        second = engine.submit(engine.plan(validate_systemone(body(doc, 2), M)))
        time.sleep(4 * _Pipelined.DEVICE_S)  # past the flight's expected end: the lane looks at its queue
        pipe.gate.set()
        first.result(WAIT)
        outcome = second.result(WAIT)
        assert engine.cache_snapshot()["hits"] == hits + 1  # the second request continued the stored document
        assert outcome.cached_tokens > 250
        want, _ = ask(reference, body(doc, 2))
        assert np.abs(probs(response_body(outcome, "systemone", 0.0)["answers"]) - want).max() <= 1e-6
    finally:
        pipe.gate.set()
        engine.stop(WAIT)


def test_a_job_waiting_for_the_flights_document_rides_the_very_next_batch(tiny_model, reference):
    """While a batch storing a new document is on the device, a request about that document and one about
    another arrive: the lane answers the flight first and then forms one batch of both (the first a hit), rather
    than launching the other's batch meanwhile and leaving the waiting request a whole batch later."""
    engine = make_engine(tiny_model, wrap=_Pipelined)
    pipe = engine.backend
    try:
        for seed in (50, 51):  # the lane learns the device time of batches this size: the next ones overlap
            ask(engine, body(document(seed), 0))
        doc, other = document(52), document(53)
        hits = engine.cache_snapshot()["hits"]
        pipe.gate.clear()
        pipe.launched.clear()
        first = engine.submit(engine.plan(validate_systemone(body(doc, 1), M)))
        assert pipe.launched.wait(WAIT)
        waiting = engine.submit(engine.plan(validate_systemone(body(doc, 2), M)))
        fresh = engine.submit(engine.plan(validate_systemone(body(other, 3), M)))
        time.sleep(4 * _Pipelined.DEVICE_S)  # past the flight's expected end: the lane looks at its queue
        pipe.gate.set()
        one, two, three = first.result(WAIT), waiting.result(WAIT), fresh.result(WAIT)
        assert two.batch_id == three.batch_id == one.batch_id + 1 and two.batch_requests == 2
        assert engine.cache_snapshot()["hits"] == hits + 1 and two.cached_tokens > 250
        for outcome, payload in ((two, body(doc, 2)), (three, body(other, 3))):
            want, _ = ask(reference, payload)
            assert np.abs(probs(response_body(outcome, "systemone", 0.0)["answers"]) - want).max() <= 1e-6
    finally:
        pipe.gate.set()
        engine.stop(WAIT)


def test_a_document_is_in_flight_from_its_reservation_until_its_batch_completes_or_fails():
    cache = _cache(4000)
    doc = list(range(1000, 1600))
    assert not cache.in_flight(doc + [7])
    entry = cache.reserve(doc)
    assert cache.in_flight(doc + [7]) and cache.in_flight(doc[:300] + [7])  # shares 300 of its tokens
    assert not cache.in_flight(doc[:200] + [7])  # too little of it to wait for (FILL_MIN_TOKENS)
    cache.publish(entry)
    assert not cache.in_flight(doc + [7])  # stored: a lookup finds it
    assert cache.match(doc + [7]).length == len(doc)
    failed = cache.reserve(list(range(5000, 5400)))
    assert cache.in_flight(list(range(5000, 5400)) + [1])
    cache.drop(failed)  # the batch failed
    assert not cache.in_flight(list(range(5000, 5400)) + [1])


def test_a_held_job_is_matched_again_only_once_the_entries_change():
    """Lane._hold_documents_in_flight asks the cache about a job's document once per change of the pending or
    stored entries, not at every look (a held job is looked at every few ms)."""
    from types import SimpleNamespace

    from basal_local.engine.lane import Lane
    from basal_local.engine.packer import PromptSpec
    from basal_local.engine.scheduler import Job

    cache = _cache(4000)
    doc = list(range(1000, 1600))
    entry = cache.reserve(doc)
    asked = []
    real = cache.in_flight
    cache.in_flight = lambda ids: asked.append(1) or real(ids)
    lane = Lane(SimpleNamespace(cache=cache, replica=0, model=SimpleNamespace(name=M)), "main", urgent=True)
    job = Job(plan=None, tokens=1, specs=[PromptSpec(doc + [7, 8], "en", [1])])
    for _ in range(5):
        assert lane._hold_documents_in_flight([job]) == ([], [job])
    assert len(asked) == 1
    cache.publish(entry)  # the batch completed: looked at again, no longer held
    assert lane._hold_documents_in_flight([job]) == ([job], [])
    assert len(asked) == 2


def test_the_daemons_memory_figures_count_every_replica_and_model(tiny_model, small_model):
    """/api/stats `memory` gave one replica's weights and cache pool: with 2 replicas of one model and a second
    model, each with its own 8 MB pool, it said 8 MB and one model's weights."""
    from .conftest import InProcessDaemon, http

    d = InProcessDaemon([tiny_model, small_model], prefix_cache="8MB", replicas=2)
    d.wait_ready()
    try:
        _, _, stats = http("GET", d.url + "/api/stats")
    finally:
        d.stop()
    replicas = [r["memory"] for m in stats["models"] for r in m["replicas"]]
    assert len(replicas) == 4
    pools = [m["prefix_cache"]["budget_bytes"] for m in stats["models"]]
    assert stats["memory"]["prefix_cache_bytes"] == sum(r["prefix_cache_bytes"] for r in replicas) == sum(pools)
    assert stats["memory"]["weights_bytes"] == sum(r["weights_bytes"] for r in replicas)
    assert len({r["weights_bytes"] for r in replicas}) == 2  # two models of different sizes, both counted


def test_a_worker_process_that_is_gone_holds_no_memory_in_the_totals():
    """A dead worker's last report stays in `describe` (for its restart); its memory is freed with its process,
    while a dead in-process replica still holds its own."""
    from basal_local.server.events import held_totals

    replicas = [{"pid": 11, "alive": True, "memory": {"weights_bytes": 5}},
                {"pid": 12, "alive": False, "memory": {"weights_bytes": 5}},
                {"alive": False, "memory": {"weights_bytes": 7}}]
    assert held_totals(replicas)["weights_bytes"] == 12

"""Scheduling with a fake backend whose forward time grows with tokens (docs/ARCHITECTURE.md, docs/ARCHITECTURE.md "Scheduling")."""

from __future__ import annotations

import statistics
import threading
import time
from concurrent.futures import wait

import numpy as np
import pytest

from basal_local.api.answers import response_body
from basal_local.api.systemone import validate_systemone
from basal_local.engine.engine import EngineSettings, ModelEngine
from basal_local.engine.gate import DeviceGate
from basal_local.engine.lane import Lane
from basal_local.engine.scheduler import Cancelled
from basal_local.model import load_model_dir
from basal_local.telemetry import Telemetry

US_PER_TOKEN = 100e-6
LAYERS = 10


class FakeBackend:
    """Sleeps tokens x 100 us per forward, spread over 10 layers; counts forwards.

    `hold()` makes the next forwards wait until `release()`, so a test can queue requests behind a running
    batch without racing the clock."""

    name = "fake"
    device = "cpu"

    def __init__(self) -> None:
        self.calls = 0
        self.lock = threading.Lock()
        self.running = threading.Event()
        self._gate = threading.Event()
        self._gate.set()

    def hold(self) -> None:
        self.running.clear()
        self._gate.clear()

    def release(self) -> None:
        self._gate.set()

    def add_prefix(self, key, ids) -> None:
        pass

    def forward(self, batch):
        *_, logits = self.forward_steps(batch)
        return logits

    def forward_steps(self, batch):
        with self.lock:
            self.calls += 1
        self.running.set()
        self._gate.wait(timeout=30)
        per_layer = batch.num_tokens * US_PER_TOKEN / LAYERS
        for _ in range(LAYERS - 1):
            time.sleep(per_layer)
            yield None
        time.sleep(per_layer)
        yield np.zeros((len(batch.readout_index), len(batch.letter_ids)), dtype=np.float32)


@pytest.fixture(scope="module")
def model(tiny_model):
    return load_model_dir(tiny_model)


def make_engine(model, **settings):
    backend = FakeBackend()
    engine = ModelEngine(model, backend, DeviceGate(settings.get("long_slice_ms", 100) / 1000.0), Telemetry(),
                         EngineSettings(**settings))
    engine.start()
    return engine, backend


def plan(engine, model, words: int, tag: str = ""):
    state = ("słowo " * words) + tag
    body = {"model": model.name, "state": state, "questions": {"q": {"type": "noul", "instructions": f"Czy {tag}?"}}}
    return engine.plan(validate_systemone(body, model.name))


def submit_timed(engine, p, done_at: dict, key, **kw):
    job = engine.submit(p, **kw)
    job.add_done_callback(lambda f: done_at.__setitem__(key, time.perf_counter()))
    return job


@pytest.mark.parametrize("schedule", ["hrrn", "fifo"])
def test_short_requests_overtake_a_long_one_only_with_hrrn(model, schedule):
    engine, backend = make_engine(model, schedule=schedule, long_tokens=0, max_batch_tokens=600)
    try:
        done: dict = {}
        long_plan = plan(engine, model, 1200, "long")
        assert long_plan.packed_tokens > 1000
        short_plans = [plan(engine, model, 5, f"s{i}") for i in range(4)]
        backend.hold()
        blocker = submit_timed(engine, plan(engine, model, 1200, "blocker"), done, "blocker")
        assert backend.running.wait(timeout=30)
        long_plan.arrival = time.perf_counter()
        jobs = [submit_timed(engine, long_plan, done, "long")]
        time.sleep(0.01)  # the long one arrived first
        for i, p in enumerate(short_plans):
            p.arrival = time.perf_counter()
            jobs.append(submit_timed(engine, p, done, f"s{i}"))
        backend.release()
        wait([blocker] + jobs, timeout=30)
        shorts_before_long = all(done[f"s{i}"] < done["long"] for i in range(4))
        assert shorts_before_long == (schedule == "hrrn")
    finally:
        engine.stop()


def short_p95_under_mixed_load(model, **settings) -> tuple[float, int]:
    engine, _ = make_engine(model, **settings)
    try:
        shorts = [plan(engine, model, 5, f"s{i}") for i in range(40)]
        longs = [plan(engine, model, 1200, f"L{i}") for i in range(4)]
        latencies: list[float] = []
        futures = []
        start = time.perf_counter()
        for i, p in enumerate(shorts):
            if i % 13 == 0:
                futures.append(engine.submit(longs[i // 13]))
            p.arrival = time.perf_counter()
            job = engine.submit(p)
            job.add_done_callback(lambda f, t=p.arrival: latencies.append(time.perf_counter() - t))
            futures.append(job)
            time.sleep(0.02)
        wait(futures, timeout=60)
        assert len(latencies) == len(shorts) and time.perf_counter() - start < 60
        return sorted(latencies)[int(0.95 * len(latencies)) - 1] * 1000.0, engine.gate.handoffs
    finally:
        engine.stop()


def test_long_lane_keeps_short_p95_far_below_fifo(model):
    fifo_p95, _ = short_p95_under_mixed_load(model, schedule="fifo", long_tokens=0)
    lane_p95, handoffs = short_p95_under_mixed_load(model, schedule="hrrn", long_tokens=1000, long_slice_ms=20)
    print(f"short-request p95: fifo single lane {fifo_p95:.1f} ms, hrrn + long lane {lane_p95:.1f} ms "
          f"({handoffs} hand-offs)")
    assert handoffs > 0
    assert lane_p95 < fifo_p95 / 2


def test_long_lane_runs_one_request_at_a_time(model):
    """Requests above long_tokens queue in the long lane; each batch there holds exactly one of them."""
    engine, backend = make_engine(model, long_tokens=300, max_batch_tokens=100_000)
    try:
        plans = [plan(engine, model, 400, f"long{i}") for i in range(4)]
        assert all(p.packed_tokens > 300 for p in plans)
        backend.hold()
        jobs = [engine.submit(plans[0])]
        assert backend.running.wait(timeout=30)
        jobs += [engine.submit(p) for p in plans[1:]]  # three wait together in the long lane's queue
        assert engine.long.waiting() == 3
        backend.release()
        results = [j.result(timeout=30) for j in jobs]
        long_batches = [b for b in engine.telemetry.batches if b.lane == "long"]
        assert [b.requests for b in long_batches] == [1, 1, 1, 1]
        assert all(r.batch_requests == 1 for r in results)
        assert not [b for b in engine.telemetry.batches if b.lane == "main"]
    finally:
        engine.stop()


def test_cancelled_requests_cost_no_forward(model):
    engine, backend = make_engine(model, long_tokens=0)
    try:
        backend.hold()  # the lane holds the blocker's forward until the others are queued behind it
        blocker = engine.submit(plan(engine, model, 1200, "blocker"))
        assert backend.running.wait(timeout=30)
        gone = [engine.submit(plan(engine, model, 5, f"g{i}"), is_cancelled=lambda: True) for i in range(5)]
        kept = engine.submit(plan(engine, model, 5, "kept"))
        backend.release()
        kept.result(timeout=30)
        blocker.result(timeout=30)
        for job in gone:
            with pytest.raises(Cancelled):
                job.result(timeout=5)
        assert backend.calls == 2
        assert engine.telemetry.counters["cancelled"] == 5
    finally:
        engine.stop()


def test_batches_form_within_the_token_budget(model):
    engine, backend = make_engine(model, long_tokens=0, max_batch_tokens=8192)
    try:
        plans = [plan(engine, model, 20, f"s{i}") for i in range(10)]
        backend.hold()
        blocker = engine.submit(plan(engine, model, 600, "blocker"))
        assert backend.running.wait(timeout=30)
        jobs = [engine.submit(p) for p in plans]
        backend.release()
        results = [j.result(timeout=30) for j in jobs]
        blocker.result(timeout=30)
        assert max(r.batch_requests for r in results) == 10  # queued during the blocker, one batch after it
        assert backend.calls == 2
        record = engine.telemetry.batches[-1]
        assert record.requests == 10 and record.packed_tokens < record.unpacked_tokens
        assert statistics.mean(r.queue_ms for r in results) > 0
    finally:
        engine.stop()


def test_client_disconnect_over_http_drops_the_request_before_compute(model):
    """A real socket closed while its request waits: the engine drops it and never computes it."""
    import asyncio
    import json
    import socket

    import uvicorn

    from basal_local.server.app import AppState, create_app

    from .conftest import free_port

    engine, backend = make_engine(model, long_tokens=0)
    state = AppState(engines={model.name: engine}, default_model=model.name, ready=True)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(create_app(state), host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=lambda: asyncio.run(server.serve()), daemon=True)
    thread.start()
    try:
        while not server.started:
            time.sleep(0.01)
        # the lane holds the blockers' forward until the request has been dropped (no race with the clock)
        backend.hold()
        blockers = [engine.submit(plan(engine, model, 1200, f"blocker{i}")) for i in range(2)]
        assert backend.running.wait(timeout=30)
        body = json.dumps({"model": model.name, "state": "x",
                           "questions": {"n": {"type": "noul", "instructions": "i"}}}).encode()
        queued = engine.waiting()  # 0, or 1 when the lane took the first blocker alone
        with socket.create_connection(("127.0.0.1", port)) as sock:
            sock.sendall(b"POST /v1/systemone HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
            deadline = time.time() + 5
            while engine.waiting() == queued and time.time() < deadline:
                time.sleep(0.002)
            assert engine.waiting() == queued + 1 and not blockers[0].done()
        time.sleep(0.3)  # the daemon reads the disconnect (the lane is held meanwhile)
        backend.release()  # the socket is closed: the queued request is gone before its batch forms
        for blocker in blockers:
            blocker.result(timeout=30)
        deadline = time.time() + 5
        while engine.telemetry.counters["cancelled"] == 0 and time.time() < deadline:
            time.sleep(0.01)
        assert engine.telemetry.counters["cancelled"] == 1
        # only the blockers were computed: every forward belongs to a batch of blockers
        assert sum(b.requests for b in engine.telemetry.batches) == 2
        assert backend.calls == len(engine.telemetry.batches)
        time.sleep(0.05)
        assert state.inflight == 0  # the slot was released
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        engine.stop()


def test_answers_alone_equal_answers_in_a_batch_of_32(tiny_model):
    from basal_local.backends.torch import TorchBackend
    from basal_local.bench import single_question_requests

    md = load_model_dir(tiny_model)
    backend = TorchBackend("cpu")
    backend.load(tiny_model, "f32")
    engine = ModelEngine(md, backend, DeviceGate(), Telemetry(), EngineSettings(long_tokens=0))
    engine.start()
    try:
        plans = [engine.plan(validate_systemone(r, md.name)) for r in single_question_requests(md.name)[:32]]
        alone = [engine.submit(p).result(timeout=60) for p in plans]
        blocker = engine.submit(plans[0])
        batched_jobs = [engine.submit(p) for p in plans]
        blocker.result(timeout=60)
        batched = [j.result(timeout=60) for j in batched_jobs]
        assert max(r.batch_requests for r in batched) >= 16
        worst = 0.0
        for a, b in zip(alone, batched):
            for qid, ans in response_body(a, "systemone", 0.0)["answers"].items():
                pa = ans.get("probabilities", {"p": ans.get("noul")})
                pb = response_body(b, "systemone", 0.0)["answers"][qid].get("probabilities", {"p": response_body(b, "systemone", 0.0)["answers"][qid].get("noul")})
                worst = max(worst, max(abs(pa[k] - pb[k]) for k in pa))
        assert worst <= 1e-6, worst
    finally:
        engine.stop()


def test_small_queue_waits_briefly_for_the_last_batch_to_come_back():
    """Batch coalescing: after a batch of 30, a queue of 2 waits (at most coalesce_ms) until 15 are back, so
    closed-loop clients do not alternate full and tiny batches; after a batch of 1 nothing waits."""
    import types

    engine = types.SimpleNamespace(model=types.SimpleNamespace(name="m"), replica=0,
                                   settings=EngineSettings(coalesce_ms=400))
    lane = Lane(engine, "main", urgent=True)
    lane.queue = ["a", "b"]
    lane.last_jobs, lane.last_s, lane.last_end = 30, 2.0, time.perf_counter()

    came_back: list[float] = []

    def come_back():
        time.sleep(0.02)
        came_back.append(time.perf_counter())
        for i in range(13):
            lane.put(i)

    threading.Thread(target=come_back).start()
    t0 = time.perf_counter()
    with lane._cond:
        lane._coalesce()
    ended = time.perf_counter()
    # it waited for the requests that came back (not for a clock: the thread may start late on a loaded machine)
    assert len(lane.queue) >= 15 and came_back and ended >= came_back[0] and ended - t0 < 0.3
    # nobody comes back: the window ends the wait
    lane.queue = ["a"]
    lane.last_end, engine.settings.coalesce_ms = time.perf_counter(), 30
    t0 = time.perf_counter()
    with lane._cond:
        lane._coalesce()
    assert 0.02 <= time.perf_counter() - t0 < 0.3 and lane.queue == ["a"]
    # after a batch of one (a single client) a request never waits
    lane.last_jobs, lane.last_end = 1, time.perf_counter()
    t0 = time.perf_counter()
    with lane._cond:
        lane._coalesce()
    assert time.perf_counter() - t0 < 0.01

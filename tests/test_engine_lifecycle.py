"""No single job can hurt another job or a lane: cancelled futures, stop, and handler cancellation over a socket.

The awaiting task cancels a job's future whenever the server cancels a handler (shutdown, a server-side
timeout); the engine must then neither fail the job's batch-mates nor lose its lane thread.
"""

from __future__ import annotations

import json
import queue
import threading
import time
import urllib.request
from concurrent.futures import CancelledError
from pathlib import Path

import numpy as np
import pytest

from basal_local.api.systemone import validate_systemone
from basal_local.engine.engine import EngineSettings, ModelEngine
from basal_local.engine.gate import DeviceGate
from basal_local.engine.scheduler import Cancelled, EngineStopped
from basal_local.model import load_model_dir
from basal_local.protocol.outcome import Outcome
from basal_local.telemetry import KEEP_UNBUILT, BatchRecord, Lazy, Telemetry, resolve

from .conftest import free_port

WAIT = 20.0  # seconds before a test calls a hang a hang


class SteppedBackend:
    """A fake backend whose every forward announces itself and waits for the test's permission."""

    name = "stepped"
    device = "cpu"

    def __init__(self) -> None:
        self.entered: queue.Queue[int] = queue.Queue()
        self.permits = threading.Semaphore(0)
        self.calls = 0

    def add_prefix(self, key, ids) -> None:
        pass

    def forward(self, batch):
        self.calls += 1
        self.entered.put(len(batch.readout_index))
        if not self.permits.acquire(timeout=WAIT):
            raise TimeoutError("the test never released this forward")
        return np.zeros((len(batch.readout_index), len(batch.letter_ids)), dtype=np.float32)

    def forward_steps(self, batch):
        yield self.forward(batch)

    def wait_entered(self) -> None:
        self.entered.get(timeout=WAIT)

    def release(self, n: int = 1) -> None:
        for _ in range(n):
            self.permits.release()


@pytest.fixture(scope="module")
def model(tiny_model):
    return load_model_dir(tiny_model)


@pytest.fixture
def engine(model):
    backend = SteppedBackend()
    eng = ModelEngine(model, backend, DeviceGate(), Telemetry(), EngineSettings(long_tokens=0))
    eng.start()
    yield eng, backend
    backend.release(100)
    eng.stop(timeout=WAIT)


def plan(engine: ModelEngine, tag: str):
    body = {"model": engine.model.name, "state": f"State {tag}.",
            "questions": {"q": {"type": "noul", "instructions": f"Is {tag} urgent?"}}}
    return engine.plan(validate_systemone(body, engine.model.name))


def test_a_job_cancelled_in_the_queue_hurts_neither_its_batch_nor_the_lane(engine):
    eng, backend = engine
    blocker = eng.submit(plan(eng, "blocker"))
    backend.wait_entered()  # the lane is inside the blocker's forward: what follows queues up
    kept = eng.submit(plan(eng, "kept"))
    cancelled = eng.submit(plan(eng, "cancelled"))
    both = eng.submit(plan(eng, "both"), is_cancelled=lambda: True)  # client gone AND future cancelled
    assert cancelled.cancel() and both.cancel()
    backend.release(2)  # the blocker's forward, then the next batch
    assert isinstance(blocker.result(WAIT), Outcome)
    assert isinstance(kept.result(WAIT), Outcome)
    assert cancelled.cancelled() and both.cancelled()
    assert eng.telemetry.counters["cancelled"] == 2
    # the lane is alive: a later request is answered
    later = eng.submit(plan(eng, "later"))
    backend.release()
    assert isinstance(later.result(WAIT), Outcome)
    assert eng.main.thread.is_alive()


def test_a_job_cancelled_during_compute_does_not_fail_its_batch_mates(engine):
    eng, backend = engine
    blocker = eng.submit(plan(eng, "blocker"))
    backend.wait_entered()
    a = eng.submit(plan(eng, "a"))
    b = eng.submit(plan(eng, "b"))
    backend.release()  # the blocker finishes; a and b form one batch
    backend.wait_entered()
    assert blocker.result(WAIT)
    assert a.cancel()  # the waiter goes away while a's batch computes
    backend.release()
    result = b.result(WAIT)
    assert isinstance(result, Outcome) and result.batch_requests == 2
    with pytest.raises(CancelledError):
        a.result(0)
    later = eng.submit(plan(eng, "later"))
    backend.release()
    assert isinstance(later.result(WAIT), Outcome)


def test_a_broken_cancellation_flag_does_not_stop_the_lane(engine):
    eng, backend = engine

    def broken() -> bool:
        raise RuntimeError("flag exploded")

    job = eng.submit(plan(eng, "flag"), is_cancelled=broken)
    backend.release()
    assert isinstance(job.result(WAIT), Outcome)


def test_an_answer_that_fails_fails_only_its_own_request(engine, monkeypatch):
    eng, backend = engine
    import basal_local.engine.engine as engine_module

    real_finish = engine_module.finish

    def finish(p, *args, **kwargs):
        if "poison" in p.request.state_text:
            raise ValueError("poisoned answer")
        return real_finish(p, *args, **kwargs)

    monkeypatch.setattr(engine_module, "finish", finish)
    blocker = eng.submit(plan(eng, "blocker"))
    backend.wait_entered()
    poison, fine = eng.submit(plan(eng, "poison")), eng.submit(plan(eng, "fine"))
    backend.release(2)
    assert blocker.result(WAIT)
    assert fine.result(WAIT).batch_requests == 2
    with pytest.raises(ValueError, match="poisoned"):
        poison.result(WAIT)


def test_stop_fails_queued_jobs_finishes_the_running_batch_and_joins_the_threads(model):
    backend = SteppedBackend()
    eng = ModelEngine(model, backend, DeviceGate(), Telemetry(), EngineSettings(long_tokens=64))
    eng.start()
    running = eng.submit(plan(eng, "running"))
    backend.wait_entered()
    queued = [eng.submit(plan(eng, f"queued {i}")) for i in range(3)]
    stopped = []
    stopper = threading.Thread(target=lambda: stopped.append(eng.stop(timeout=WAIT)))
    stopper.start()
    for job in queued:  # failed at once, while the running batch still computes
        with pytest.raises(EngineStopped):
            job.result(WAIT)
    assert not running.done()
    backend.release()
    stopper.join(WAIT)
    assert stopped == [True]
    assert isinstance(running.result(0), Outcome)
    assert not any(lane.thread.is_alive() for lane in eng.lanes())
    late = eng.submit(plan(eng, "late"))
    with pytest.raises(EngineStopped):
        late.result(0)


def test_cancelled_requests_are_counted_once_and_never_computed(engine):
    eng, backend = engine
    blocker = eng.submit(plan(eng, "blocker"))
    backend.wait_entered()
    gone = [eng.submit(plan(eng, f"gone {i}"), is_cancelled=lambda: True) for i in range(4)]
    backend.release()
    assert blocker.result(WAIT)
    for job in gone:
        with pytest.raises(Cancelled):
            job.result(WAIT)
    assert backend.calls == 1


# ---- telemetry of batches: failed batches, trees built only when read ------------------------------------

def test_a_failed_batch_is_no_longer_running(engine):
    """The lane's `running` entry goes with the failure (not at the lane's next batch), and a `batch_failed`
    event names the batch, so a dashboard clears it too."""
    eng, backend = engine
    telemetry = eng.telemetry
    sub = telemetry.bus.subscribe()
    real_forward = backend.forward

    def broken(batch):
        real_forward(batch)  # announces itself and waits for the test
        raise RuntimeError("the device fell over")

    backend.forward = broken
    doomed = eng.submit(plan(eng, "doomed"), request_id="doomed")
    backend.wait_entered()
    key = f"{eng.model.name}/main"
    assert telemetry.running[key]["requests"] == 1  # computing now
    backend.release()
    with pytest.raises(RuntimeError, match="fell over"):
        doomed.result(WAIT)
    assert key not in telemetry.running and telemetry.snapshot()["running"] == {}
    events = sub.drain()[0]
    batched = next(e for e in events if e["kind"] == "batched")
    failed = [e for e in events if e["kind"] == "batch_failed"]
    assert len(failed) == 1 and failed[0]["batch_id"] == batched["batch_id"] and failed[0]["lane"] == "main"
    assert "fell over" in failed[0]["error"] and not any(e["kind"] == "computed" for e in events)
    backend.forward = real_forward
    later = eng.submit(plan(eng, "later"))
    backend.release()
    assert isinstance(later.result(WAIT), Outcome) and key not in telemetry.running
    sub.close()


def _walk(nodes):
    for node in nodes:
        yield node
        yield from _walk(node.get("children", []))


def test_a_batch_tree_is_built_only_when_someone_reads_it(engine):
    eng, backend = engine
    telemetry = eng.telemetry
    alone = eng.submit(plan(eng, "alone"), request_id="alone")
    backend.release()
    assert isinstance(alone.result(WAIT), Outcome)
    record = telemetry.batches[-1]
    # nobody listens: the record holds a builder, never a tree
    assert isinstance(record.tree, Lazy) and not record.tree.built and telemetry.trees_built == 0
    sub = telemetry.bus.subscribe()  # an /api/events reader
    watched = eng.submit(plan(eng, "watched"), request_id="watched")
    backend.release()
    assert isinstance(watched.result(WAIT), Outcome)
    computed = next(e for e in sub.drain()[0] if e["kind"] == "computed")
    assert telemetry.trees_built == 0  # handed over unbuilt: the reader's serialization builds it
    sent = json.loads(json.dumps(computed, default=resolve))  # what /api/events writes
    assert telemetry.trees_built == 1
    nodes = [n for row in sent["tree"] for n in _walk(row["children"])]
    assert sum(n["tokens"] for n in nodes) == sent["packed_tokens"] > 0
    assert {o[0] for n in nodes for o in n.get("owners", [])} == {"watched"}
    json.dumps(computed, default=resolve)
    assert telemetry.trees_built == 1  # built once, however many readers
    # /api/stats builds the earlier one when asked, and only then
    snap = telemetry.snapshot()
    assert all(isinstance(b["tree"], list) and b["tree"] for b in snap["batches"]) and telemetry.trees_built == 2
    sub.close()


def test_unread_trees_beyond_the_window_let_their_tries_go():
    telemetry = Telemetry()
    built = []
    lazies = []
    for n in range(KEEP_UNBUILT + 5):
        lazy = telemetry.lazy_tree(lambda n=n: built.append(n) or [{"tokens": n}])
        lazies.append(lazy)
        telemetry.record_batch(BatchRecord(n, "m", "main", 1, 1, 1, 1, 1, 1, 1.0, 0.0, tree=lazy,
                                           memory={"x": 1}))
    assert [lazy.value() for lazy in lazies[:5]] == [None] * 5 and built == []  # forgotten, never built
    assert lazies[5].value() == [{"tokens": 5}] and lazies[-1].value() == [{"tokens": KEEP_UNBUILT + 4}]
    assert telemetry.trees_built == 2


def test_a_tree_that_fails_to_build_reads_as_null_and_breaks_no_reader():
    lazy = Lazy(lambda: 1 / 0)
    assert json.dumps({"tree": lazy}, default=resolve) == '{"tree": null}' and lazy.built
    with pytest.raises(TypeError):
        json.dumps({"x": object()}, default=resolve)


def test_multi_branches_and_large_choice_rounds_are_named_in_the_tree(engine):
    eng, backend = engine
    body = {"model": eng.model.name, "state": "A parcel arrived broken and late.", "questions": {
        "labels": {"type": "multi", "instructions": "Which problems?", "criteria": {"damage": "Damage", "late": "Late"}},
        "big": {"type": "choice", "instructions": "Pick one.", "criteria": {f"k{i}": f"Option {i}" for i in range(13)}}}}
    planned = eng.plan(validate_systemone(body, eng.model.name))
    sub = eng.telemetry.bus.subscribe()
    job = eng.submit(planned, request_id="units")  # both rounds: the groups, then the large choice's finalists
    backend.release(2)
    job.result(WAIT)
    trees = [json.loads(json.dumps(e, default=resolve))["tree"] for e in sub.drain()[0] if e["kind"] == "computed"]
    assert len(trees) == 2
    first = [n for row in trees[0] for n in _walk(row["children"])]
    units = {n.get("unit") for n in first if n["kind"] == "question"}
    assert {"multi: damage", "multi: late"} <= units
    owner_units = {o[3] for n in first for o in n.get("owners", [])}
    # 13 options: two partitions of two groups each (protocol/large_choice.py), read out in one order each
    assert {"round 1, group 1", "round 1, group 4"} <= owner_units and "round 2" not in owner_units
    second = [n for row in trees[1] for n in _walk(row["children"])]
    assert {o[3] for n in second for o in n.get("owners", [])} == {"round 2"}
    sub.close()


# ---- over a real socket ------------------------------------------------------------------------------------

def _serve(app, port: int, graceful_s: float):
    import uvicorn

    config = uvicorn.Config(app, host="127.0.0.1", port=port, log_level="critical",
                            timeout_graceful_shutdown=graceful_s)
    server = uvicorn.Server(config)
    server.install_signal_handlers = lambda: None  # not the main thread
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.time() + WAIT
    while not server.started:
        if time.time() > deadline:
            raise TimeoutError("uvicorn did not start")
        time.sleep(0.02)
    return server, thread


def _post(url: str, out: list, timeout: float = WAIT) -> None:
    body = b'{"model": "basal-test-tiny", "state": "s", "questions": {"q": {"type": "noul", "instructions": "i"}}}'
    try:
        with urllib.request.urlopen(urllib.request.Request(url, body), timeout=timeout) as resp:
            out.append(resp.status)
    except Exception as exc:  # the server went away mid-request: that is the point
        out.append(type(exc).__name__)


def test_handlers_cancelled_by_the_server_leave_the_engine_serving(tiny_model):
    """uvicorn cancels every handler still running when its graceful shutdown times out; the jobs' futures
    are cancelled while queued and while computing. The same engine then answers through a new server."""
    from basal_local.server.app import AppState, create_app
    from basal_local.server.daemon import load_engines, shutdown
    from basal_local.server.settings import Settings

    settings = Settings.load({"device": "cpu", "long_tokens": 0}, config_file=Path("/nonexistent"))
    state = AppState()
    load_engines(state, settings, [tiny_model])
    assert state.ready, state.load_error
    engine = state.engines["basal-test-tiny"]
    real_forward = engine.backend.forward
    slow = threading.Event()

    def forward(batch):
        if slow.is_set():
            time.sleep(1.0)
        return real_forward(batch)

    engine.backend.forward = forward
    try:
        slow.set()
        port = free_port()
        server, thread = _serve(create_app(state), port, graceful_s=0.3)
        statuses: list = []
        clients = [threading.Thread(target=_post, args=(f"http://127.0.0.1:{port}/v1/systemone", statuses))
                   for _ in range(6)]
        for c in clients:
            c.start()
        deadline = time.time() + WAIT
        while state.inflight < 6 and time.time() < deadline:  # all six admitted: computing or queued
            time.sleep(0.01)
        assert state.inflight == 6
        server.should_exit = True
        thread.join(WAIT)
        for c in clients:
            c.join(WAIT)
        assert 200 not in statuses and len(statuses) == 6  # every handler was cancelled mid-flight
        slow.clear()
        time.sleep(1.2)  # the batch that was computing finishes against cancelled futures
        assert all(lane.thread.is_alive() for lane in engine.lanes())
        port = free_port()
        server, thread = _serve(create_app(state), port, graceful_s=5)
        again: list = []
        _post(f"http://127.0.0.1:{port}/v1/systemone", again)
        assert again == [200]
        server.should_exit = True
        thread.join(WAIT)
    finally:
        shutdown(state, timeout=WAIT)
    assert not any(lane.thread.is_alive() for lane in engine.lanes())

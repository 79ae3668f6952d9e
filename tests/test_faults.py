"""Faults inside the engine, over a real socket: a failing batch, a device out of memory; serving goes on.

The daemon runs in this process (uvicorn in a thread) so the test can wrap the backend and inject faults.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from . import rawhttp
from .conftest import free_port

M = "basal-test-tiny"
SMALL = {"model": M, "state": "The parcel arrived broken.",
         "questions": {"q": {"type": "noul", "instructions": "Is this urgent?"}}}
POISON_STATE = " ".join(f"p{i}" for i in range(800))  # ~2,900 tokens: the fault keys on a long batch
# another long state for the next test: once answered, a state is in the state cache, and a new question about it
# is a short batch (engine/prefix_cache.py)
POISON_STATE_2 = " ".join(f"o{i}" for i in range(800))


class FaultyBackend:
    """The real backend, except that a batch over `poison_tokens` raises the armed exception."""

    def __init__(self, inner, poison_tokens: int = 2000) -> None:
        self.inner = inner
        self.poison_tokens = poison_tokens
        self.fault: BaseException | None = None
        self.faults_raised = 0

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def _maybe_fail(self, batch) -> None:
        if self.fault is not None and batch.num_tokens > self.poison_tokens:
            self.faults_raised += 1
            raise self.fault

    def forward(self, batch):
        self._maybe_fail(batch)
        return self.inner.forward(batch)

    def forward_steps(self, batch):
        self._maybe_fail(batch)
        return self.inner.forward_steps(batch)

    def launch(self, batch):  # the main lane's way in (engine pipelining)
        self._maybe_fail(batch)
        return self.inner.launch(batch)


@pytest.fixture(scope="module")
def live(tiny_model):
    import uvicorn

    from basal_local.server.app import AppState, create_app
    from basal_local.server.daemon import load_engines
    from basal_local.server.security import AccessPolicy, Guard
    from basal_local.server.settings import Settings

    settings = Settings.load({"device": "cpu", "long_tokens": 0}, config_file=Path("/nonexistent"))
    state = AppState()
    load_engines(state, settings, [tiny_model])
    assert state.ready, state.load_error
    engine = state.engines[M]
    faulty = FaultyBackend(engine.backend)
    engine.backend = faulty
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(Guard(create_app(state), AccessPolicy.build("127.0.0.1", None)),
                                           host="127.0.0.1", port=port, log_level="critical"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.time() + 30
    while not server.started:
        assert time.time() < deadline and thread.is_alive()
        time.sleep(0.05)
    yield port, faulty, state
    server.should_exit = True
    thread.join(timeout=15)
    for e in state.engines.values():
        e.stop()


def test_an_exception_in_one_batch_fails_only_that_batch(live):
    port, faulty, state = live
    faulty.fault = RuntimeError("injected fault")
    try:
        failed_before = state.telemetry.snapshot()["totals"]["failed"]
        status, _, body = rawhttp.post(port, "/v1/systemone", {**SMALL, "state": POISON_STATE})
        assert status == 500 and body == {"error": "internal", "detail": "RuntimeError: injected fault"}
        status, _, body = rawhttp.post(port, "/v1/basal", {**SMALL, "state": POISON_STATE})
        assert status == 500 and body == {"error": "internal: RuntimeError: injected fault"}
        assert faulty.faults_raised == 2
        assert state.telemetry.snapshot()["totals"]["failed"] == failed_before + 2
        # the same lane goes on: small batches, still armed, all answered, in parallel
        results: list[int] = []
        threads = [threading.Thread(target=lambda: results.append(rawhttp.post(port, "/v1/systemone", SMALL)[0]))
                   for _ in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
        assert results == [200] * 8
    finally:
        faulty.fault = None
    assert rawhttp.post(port, "/v1/systemone", {**SMALL, "state": POISON_STATE})[0] == 200


def test_device_out_of_memory_is_a_clear_retryable_error(live):
    torch = pytest.importorskip("torch")
    port, faulty, _ = live
    faulty.fault = torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
    try:
        for path in ("/v1/systemone", "/v1/basal"):
            status, headers, body = rawhttp.post(port, path, {**SMALL, "state": POISON_STATE_2})
            assert status == 503 and headers.get("retry-after") == "1"
            text = body["detail"]["message"] if path == "/v1/systemone" else body["error"]
            assert "ran out of memory" in text and "--max-batch-tokens" in text
        assert rawhttp.post(port, "/v1/basal", SMALL)[0] == 200
    finally:
        faulty.fault = None
    assert rawhttp.post(port, "/v1/basal", {**SMALL, "state": POISON_STATE_2})[0] == 200

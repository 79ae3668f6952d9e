"""The server drives any engine through the Engine protocol alone: a fake that implements only `model`, `plan`,
`submit`, `describe` and `stop` answers both dialects, shows in /health, /api/stats and /api/ps, and its
failures become the dialect's error bodies."""

from __future__ import annotations

from concurrent.futures import Future
from typing import Any

import pytest
from litestar.testing import TestClient

from basal_local.engine.plan import plan_request
from basal_local.engine.protocol import Engine
from basal_local.engine.scheduler import EngineStopped
from basal_local.model.directory import load_model_dir
from basal_local.protocol.errors import NoEvidenceHead
from basal_local.protocol.outcome import Outcome, QuestionOutcome
from basal_local.server.app import create_app
from basal_local.server.state import AppState


class FakeEngine:
    """Answers every question with fixed probabilities; nothing but the protocol's members."""

    def __init__(self, model, fail: BaseException | None = None) -> None:
        self.model = model
        self.fail = fail
        self.submitted: list[tuple[str, bool]] = []
        self.stopped = False

    def plan(self, request):
        return plan_request(request, self.model.tokenizer, self.model.config.max_position_embeddings)

    def submit(self, plan, is_cancelled=lambda: False, request_id: str = "") -> Future[Outcome]:
        self.submitted.append((request_id, is_cancelled()))
        future: Future[Outcome] = Future()
        if self.fail is not None:
            future.set_exception(self.fail)
            return future
        answers = {}
        for q in plan.request.questions:
            p = [1.0 / len(q.keys)] * len(q.keys) if q.qtype != "noul" else [0.75, 0.25]
            answers[q.qid] = QuestionOutcome(q.qtype, list(q.keys), p, q.legend, q.fixed)
        future.set_result(Outcome(plan.request.model, answers, plan.input_tokens, plan.packed_tokens, 1.5, 2.0,
                                  3.0, 4, 77))
        return future

    def describe(self) -> list[dict[str, Any]]:
        return [{"model": self.model.name, "replica": 0, "device": "fake:0", "alive": True, "batches": 5,
                 "waiting": 0, "queued_tokens": 0, "requests": 2, "memory": {"weights_bytes": 123},
                 "lanes": {"main": {"waiting": 1, "waiting_tokens": 10, "oldest_wait_ms": 0.5}}}]

    def memory(self) -> dict[str, int]:
        return {"weights_bytes": 123}

    def stop(self, timeout: float | None = 30.0) -> bool:
        self.stopped = True
        return True


@pytest.fixture(scope="module")
def model(tiny_model):
    return load_model_dir(tiny_model)


def client_for(engine: FakeEngine) -> TestClient:
    state = AppState(engines={engine.model.name: engine}, default_model=engine.model.name, ready=True,
                     backend_name="fake", device="fake:0", dtype="f32")
    return TestClient(create_app(state))


def test_the_fake_implements_only_the_protocol(model):
    fake = FakeEngine(model)
    assert isinstance(fake, Engine)
    assert {n for n in vars(FakeEngine) if not n.startswith("_")} == {"plan", "submit", "describe", "memory", "stop"}


def test_the_server_answers_both_dialects_from_the_outcome(model):
    fake = FakeEngine(model)
    body = {"model": model.name, "state": "The parcel arrived broken.",
            "questions": {"urgent": {"type": "noul", "instructions": "Is it urgent?"},
                          "kind": {"type": "choice", "instructions": "Kind?", "criteria": {"a": "A", "b": "B"}}}}
    with client_for(fake) as client:
        one = client.post("/v1/systemone", json=body, headers={"x-request-id": "r1"})
        basal = client.post("/v1/basal", json=body)
        health = client.get("/health").json()
        stats = client.get("/api/stats").json()
        ps = client.get("/api/ps").json()
    assert one.status_code == 200, one.text
    answers = one.json()["answers"]
    assert answers["urgent"] == {"type": "noul", "noul": 0.75}  # the System One noul shape
    assert answers["kind"]["choice"] == "a" and answers["kind"]["probabilities"] == {"a": 0.5, "b": 0.5}
    assert one.headers["x-basal-batch-requests"] == "4" and one.headers["x-basal-queue-ms"] == "2.000"
    assert basal.status_code == 200
    urgent = basal.json()["answers"]["urgent"]  # the upstream shape: probabilities, confidence = max
    assert urgent["noul"] == 0.75 and urgent["confidence"] == 0.75 and sorted(urgent["probabilities"].values()) == \
        [0.25, 0.75]
    assert fake.submitted[0] == ("r1", False)
    assert health["replicas"] == [{"model": model.name, "replica": 0, "device": "fake:0", "alive": True,
                                  "state": "ready"}]
    assert stats["replicas"][0]["batches"] == 5 and "lanes" not in stats["replicas"][0]
    assert stats["queues"][model.name]["main"]["waiting"] == 1
    assert ps["models"][0]["queue"] == 2 and ps["models"][0]["weights_bytes"] == 123


@pytest.mark.parametrize("dialect", ["systemone", "basal"])
def test_engine_failures_are_the_dialects_errors(model, dialect):
    body = {"model": model.name, "state": "x", "questions": {"q": {"type": "noul", "instructions": "i",
                                                                   "evidence": True}}}
    with client_for(FakeEngine(model, NoEvidenceHead("q"))) as client:
        refused = client.post(f"/v1/{dialect}", json=body)
    with client_for(FakeEngine(model, EngineStopped())) as client:
        stopped = client.post(f"/v1/{dialect}", json=body)
    assert refused.status_code == 422 and "evidence_head.pt" in refused.text
    assert stopped.status_code == 500 and "engine stopped" in stopped.text

"""The real, published clients, unchanged, against a live daemon (typesafe-sdk, basal-client, jev-cli).

typesafe-sdk (sync, async, zstd bodies via backports-zstd) and basal-client come from the test extra; their
strict response models validating our answers is the point. jev-cli needs Python 3.13 by its metadata but runs
on 3.11: it is installed here with --no-deps --ignore-requires-python into the test cache (skipped when the
package index is unreachable). Also: request ids on every response, `jev-latest`, the unknown model's 400,
529 retry spreading measured with 20 concurrent SDK calls against --max-inflight 1, and /metrics.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import sys
import threading
import time
from importlib.util import find_spec

import pytest

from .conftest import CACHE, Daemon, InProcessDaemon, http

# Found, not imported: every test worker collects this file, and importing the clients there cost ~1.7 s of CPU
# each (the tests import them where they use them).
pytestmark = pytest.mark.skipif(not (find_spec("typesafe_sdk") and find_spec("basal_client")),
                                reason="typesafe-sdk and basal-client are in the test extra")

STATE = "The parcel arrived broken and I want my money back. " * 2


@pytest.fixture(scope="module")
def served(tiny_model):
    d = InProcessDaemon([tiny_model], metrics=True)
    d.wait_ready(timeout=600)
    _, _, health = http("GET", d.url + "/health")
    d.model = health["models"][0]
    yield d
    d.stop()


def questions():
    from typesafe_sdk import Choice, Noul, Score

    return {"billing": Noul(instructions="Is this about billing?"),
            "tone": Choice(instructions="Tone?", criteria={"calm": None, "angry": "Hostile"}),
            "urgency": Score(instructions="How urgent?", criteria=["low", "mid", "high"])}


def check_typed(r) -> None:
    assert 0 <= r.nouls["billing"].noul <= 1
    assert r.choices["tone"].choice in ("calm", "angry")
    assert r.scores["urgency"].score >= 0 and set(r.scores["urgency"].probabilities) == {0, 1, 2}
    assert re.fullmatch(r"[0-9a-f]{32}", r.request_id)


def test_typesafe_sdk_sync_with_the_default_model_name(served):
    from typesafe_sdk import TypeSafeClient

    # no model given: the SDK sends "jev-latest", which resolves to the daemon's default model
    with TypeSafeClient(base_url=served.url, api_key="local", compression=False) as client:
        listed = client.models.list()
        assert [m.name for m in listed.models] == [served.model]
        r = client.system_one(state={"msg": "charged twice"}, questions=questions())
    assert r.model == served.model
    check_typed(r)


def test_typesafe_sdk_async_zstd_bodies(served):
    pytest.importorskip("backports.zstd", reason="backports-zstd makes typesafe-sdk compress (test extra)")
    from typesafe_sdk import AsyncTypeSafeClient

    async def main():
        async with AsyncTypeSafeClient(base_url=served.url, api_key="local", model=served.model) as client:
            return await client.system_one(state=STATE * 20, questions=questions())

    before = _zstd_requests(served)
    r = asyncio.run(main())
    check_typed(r)
    assert len(STATE * 20) > 1024  # above the SDK's compression threshold
    assert _zstd_requests(served) == before + 1, "the body was not sent zstd-compressed"


def _zstd_requests(served) -> int:
    """How many decision requests arrived zstd-compressed (the daemon's counter in /api/stats)."""
    _, _, stats = http("GET", served.url + "/api/stats")
    return stats["counters"].get("zstd_bodies", 0)


def test_basal_client_on_v1_basal(served):
    from basal_client import BasalClient, Questions, choice, noul, score

    class T(Questions):
        dept = choice("Which department?", {"returns": "Returns", "support": "Support"})
        urgent = noul("Is it urgent?")
        level = score("How urgent?", ["low", "mid", "high"])

    with BasalClient(served.url) as client:
        assert served.model in json.dumps(client.models())
        r = client.decide("The phone is broken.", T)
        from basal_client import BasalHTTPError

        with pytest.raises(BasalHTTPError) as refused:  # a forced language would be another prompt: refused
            client.decide("The phone is broken.", T, lang="en")
    assert refused.value.status_code == 422 and refused.value.body["detail"][0]["loc"] == ["body", "lang"]
    assert r.answers.dept.choice in ("returns", "support")
    assert 0 <= r.answers.urgent.noul <= 1 and r.answers.level.score >= 0
    assert r.usage["input_tokens"] > 0


def jev_cli_path():
    target = CACHE / "jev-cli-0.7.0"
    if not (target / "jev_cli" / "__init__.py").exists():
        done = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--ignore-requires-python",
                               "--target", str(target), "jev-cli==0.7.0"], capture_output=True, text=True,
                              timeout=300)
        if done.returncode != 0:
            last = (done.stderr.strip().splitlines() or ["no output"])[-1]
            pytest.skip(f"cannot install jev-cli (package index unreachable?): {last}")
    return target


def test_jev_cli(served):
    target = jev_cli_path()
    env = {**os.environ, "PYTHONPATH": str(target), "JEV_PROVIDER": "custom", "JEV_API_KEY": "local",
           "JEV_ENDPOINT": served.url + "/v1/systemone"}

    def jev(*args):
        return subprocess.run([sys.executable, "-c", "import sys, jev_cli; sys.exit(jev_cli.main())", *args],
                              capture_output=True, text=True, env=env, timeout=60)

    # no JEV_MODEL: jev-cli sends jev-latest
    done = jev("noul", "-q", "Is this urgent?", "-s", "Restore service today.", "--value")
    assert done.returncode == 0, done.stderr
    assert 0 <= float(done.stdout) <= 1
    done = jev("choice", "-q", "Which team?", "-s", "payment fails", "-o", "billing=Payments", "-o",
               "technical=Bugs", "--value")
    assert done.returncode == 0 and done.stdout.strip() in ("billing", "technical"), done.stderr
    done = jev("score", "-q", "How bad?", "-s", "x", "-l", "low", "-l", "high", "--value")
    assert done.returncode == 0 and 0 <= float(done.stdout) <= 1, done.stderr


def test_request_ids_on_every_response(served):
    # errors too: 404 and 405 come from the router (before any route middleware), 403 from the access guard
    for method, path, extra, want in (("GET", "/v1/models", {}, 200), ("GET", "/health", {}, 200),
                                      ("GET", "/api/stats", {}, 200), ("GET", "/openapi.json", {}, 200),
                                      ("POST", "/v1/systemone", {}, 422), ("GET", "/no/such/path", {}, 404),
                                      ("DELETE", "/v1/systemone", {}, 405),
                                      ("GET", "/v1/models", {"origin": "http://evil.example"}, 403)):
        status, headers, _ = http(method, served.url + path, {} if method == "POST" else None, headers=extra)
        lower = {k.lower(): v for k, v in headers.items()}
        assert status == want, (method, path, status)
        assert lower.get("x-request-id") and lower["x-request-id"] == lower.get("x-typesafe-request-id"), path
    for path, extra in (("/v1/models", {}), ("/nowhere", {}), ("/v1/models", {"origin": "http://evil.example"})):
        _, headers, _ = http("GET", served.url + path, headers={"x-request-id": "abc-123", **extra})
        assert {k.lower(): v for k, v in headers.items()}["x-typesafe-request-id"] == "abc-123", path


def test_nothing_of_the_app_runs_in_a_worker_thread_per_request():
    """Litestar runs a plain-function hook (`before_send`, `after_exception`) or a sync handler marked
    sync_to_thread in a worker thread: `before_send` alone was a thread-pool hop per ASGI message, two per
    response (a single request 4.15 -> 3.8 ms p50 over HTTP on the 2-core CPU once it ran in the event loop)."""
    from litestar.utils.sync import AsyncCallable

    from basal_local.server.app import AppState, create_app

    app = create_app(AppState())
    hooks = [*app.before_send, *app.after_exception]
    assert hooks and not any(isinstance(h, AsyncCallable) for h in hooks), hooks
    for route in app.routes:
        for handler in getattr(route, "route_handlers", []):
            assert not (handler.has_sync_callable and handler.sync_to_thread), (route.path, handler.handler_name)


def test_unknown_model_names_the_served_ones(served):
    status, headers, body = http("POST", served.url + "/v1/systemone", {"model": "nope-1", "state": "s", "questions": {
        "q": {"type": "noul", "instructions": "ok?"}}})
    assert status == 400 and body["detail"]["message"] == "Unknown model: nope-1"  # TypeSafe's exact text
    assert {k.lower(): v for k, v in headers.items()}["x-basal-served-models"] == served.model


def test_openapi_describes_both_dialects(served):
    status, _, doc = http("GET", served.url + "/openapi.json")
    assert status == 200 and doc["openapi"].startswith("3.")
    assert {"/v1/systemone", "/v1/basal", "/v1/models"} <= set(doc["paths"])
    assert "529" in doc["paths"]["/v1/systemone"]["post"]["responses"]
    import urllib.request

    with urllib.request.urlopen(served.url + "/docs") as resp:
        assert resp.status == 200 and "/openapi.json" in resp.read().decode()


def test_metrics(served):
    import urllib.request

    http("POST", served.url + "/v1/systemone", {"model": served.model, "state": "secret text 42",
                                                "questions": {"q": {"type": "noul", "instructions": "ok?"}}})
    http("POST", served.url + "/v1/systemone", {"model": "secret-model-name", "state": "s", "questions": {}})
    # a served model's refusal is counted under its name (an operator sees which model gets the errors)
    bad = http("POST", served.url + "/v1/systemone", {"model": served.model, "state": "s",
                                                      "questions": {"q": {"type": "noul"}}})
    with urllib.request.urlopen(served.url + "/metrics") as resp:
        text = resp.read().decode()
        # one content type with one charset: Prometheus (Go's mime parser) refuses a repeated parameter
        assert resp.headers.get_all("content-type") == ["text/plain; version=1.0.0; charset=utf-8"]
    for name in ("basal_http_requests_total", "basal_http_request_duration_seconds_bucket",
                 "basal_http_inflight_requests", "basal_model_inflight_requests", "basal_max_inflight_requests",
                 "basal_input_tokens_total", "basal_output_tokens_total", "basal_questions_total",
                 "basal_queue_duration_seconds_bucket", "basal_batch_duration_seconds_bucket",
                 "basal_batch_requests_bucket"):
        assert name in text, name
    assert f'basal_http_requests_total{{endpoint="/v1/systemone",model="{served.model}",status="200"}}' in text
    assert 'status="400"' in text
    assert f'basal_http_requests_total{{endpoint="/v1/systemone",model="{served.model}",status="{bad[0]}"}}' in text
    assert bad[0] in (400, 422)
    assert 'basal_http_requests_total{endpoint="/v1/systemone",model="",status="400"}' in text  # the unknown model
    assert "secret" not in text  # no request content in labels


def test_no_metrics_without_the_flag(app_client):
    assert app_client.get("/metrics").status_code == 404


def test_529_headers(tiny_model):
    from litestar.testing import TestClient

    from basal_local.server.app import AppState, create_app

    state = AppState(max_inflight=0)  # every decision is rejected as overloaded
    state.ready = True
    with TestClient(create_app(state)) as client:
        for _ in range(5):
            r = client.post("/v1/systemone", json={"model": "m", "state": "s", "questions": {}})
            assert r.status_code == 529 and r.headers["x-typesafe-request-id"]
            assert re.fullmatch(r"[1-9][0-9]*", r.headers["retry-after"])  # integer seconds, never a date
            ms = int(r.headers["retry-after-ms"])
            assert ms >= 1 and int(r.headers["retry-after"]) >= ms / 1000  # the integer is never earlier
    # how the slots are spaced and kept is tests/test_admission.py's job (here the timing is the machine's)


# Slow (out of the default run): a measurement of the machine as much as of the daemon. The daemon's side, slots
# kept for the retries that come in them, is tests/test_admission.py (fake clock); the 529 headers are
# test_529_headers; 50 bursts and an integer-only client: `git show 3dda548:tools/retry_bursts.py` (docs/RELIABILITY.md
# "Retries").
# Run it alone: `pytest -n 0 -m slow tests/test_clients.py`.
BURSTS = 5


@pytest.mark.slow
def test_20_concurrent_sdk_calls_against_max_inflight_1(tiny_model):
    from typesafe_sdk import TypeSafeClient

    d = Daemon(["--model", str(tiny_model), "--device", "cpu", "--max-inflight", "1"])
    try:
        d.wait_ready(timeout=600)
        _, _, health = http("GET", d.url + "/health")
        body = {"model": health["models"][0], "state": "Is the order late?", "questions": {  # = questions()
            "billing": {"type": "noul", "instructions": "Is this about billing?"},
            "tone": {"type": "choice", "instructions": "Tone?", "criteria": {"calm": None, "angry": "Hostile"}},
            "urgency": {"type": "score", "instructions": "How urgent?", "criteria": ["low", "mid", "high"]}}}
        t = time.perf_counter()
        for _ in range(3):
            http("POST", d.url + "/v1/systemone", body)
        one = (time.perf_counter() - t) / 3
        if 20 * one > 6.0:
            pytest.skip(f"this machine needs {one:.2f} s per decision now: 20 of them one at a time cannot fit "
                        "typesafe-sdk's default budget (3 attempts, 10 s each, 30 s in all)")
        results, errors = [], []
        barrier = threading.Barrier(20)

        def call(barrier):
            try:
                with TypeSafeClient(base_url=d.url, api_key="local", model=health["models"][0],
                                    compression=False) as client:
                    barrier.wait()
                    t = time.perf_counter()
                    r = client.system_one(state="Is the order late?", questions=questions())
                    results.append((time.perf_counter() - t, r))
            except Exception as exc:
                errors.append(exc)

        for _ in range(BURSTS):  # one burst after the other: the slots of one must not spoil the next (30.2)
            barrier = threading.Barrier(20)
            threads = [threading.Thread(target=call, args=(barrier,)) for _ in range(20)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
        _, _, stats = http("GET", d.url + "/api/stats")
    finally:
        d.stop()
    rejected = stats["totals"]["overloaded"]
    slowest = max((s for s, _ in results), default=0)
    print(f"{BURSTS} x 20 SDK calls vs --max-inflight 1: {len(results)} ok, {len(errors)} failed, {rejected} 529s, "
          f"slowest {slowest:.2f} s")
    assert not errors, errors[:3]
    assert len(results) == 20 * BURSTS and rejected > 0  # the limit really was hit, and the retries got through

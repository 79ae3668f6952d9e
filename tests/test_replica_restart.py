"""Replica worker processes that die (kill -9 here; a segfault or the OOM killer end a process the same way).

One `--replica-processes` daemon with two workers on the CPU, the tests in order: both workers killed while they
hold requests (every request answers, in its dialect's 503 shape with Retry-After, none hangs), /health, /api/ps and
/api/stats say so while they are down, each worker is started again after its back-off and answers as before; a
worker killed again soon after its restart waits twice as long.
"""

from __future__ import annotations

import os
import re
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from .conftest import Daemon, cli_run, http
from .test_replicas import bodies, close

WAIT = 90.0


@pytest.fixture(scope="module")
def workers(tiny_model):
    d = Daemon(["--model", str(tiny_model), "--device", "cpu", "--replicas", "2", "--replica-processes"])
    try:
        d.wait_ready(timeout=240)
        yield d
    finally:
        d.stop()


def replicas(d: Daemon) -> list[dict]:
    return http("GET", d.url + "/api/stats")[2]["replicas"]


def wait_for(what, timeout: float = WAIT, every: float = 0.05):
    deadline = time.time() + timeout
    while True:
        got = what()
        if got or time.time() > deadline:
            return got
        time.sleep(every)


def wait_all_ready(d: Daemon) -> list[dict]:
    ok = wait_for(lambda: http("GET", d.url + "/health")[2]["status"] == "ok", WAIT, 0.2)
    assert ok, d.log[-3000:]
    return replicas(d)


def test_both_workers_killed_mid_request_answer_503_and_come_back(workers, daemon):
    d = workers
    work = bodies(12)
    alone = [http("POST", daemon.url + "/v1/systemone", b)[2]["answers"] for b in work]
    before = {r["replica"]: r["pid"] for r in replicas(d)}
    # Stop both, so that what the router hands them stays in hand (a tiny request is done in milliseconds), wait
    # until both hold requests, then kill one and, once its requests moved to the other, that one too.
    for pid in before.values():
        os.kill(pid, signal.SIGSTOP)
    dialects = ["systemone", "basal"] * 6
    with ThreadPoolExecutor(12) as pool:
        futures = [pool.submit(http, "POST", f"{d.url}/v1/{dialect}", b, None, WAIT)
                   for dialect, b in zip(dialects, work)]
        # all 12 in the workers' hands first: once replica 1 is killed, replica 0 must be killed before replica 1's
        # restart (1 s + a load) could take what replica 0 holds
        held = wait_for(lambda: all(r["in_flight"] >= 1 for r in replicas(d)) and
                        sum(r["in_flight"] for r in replicas(d)) == 12)
        assert held, replicas(d)
        os.kill(before[1], signal.SIGKILL)
        # replica 1's requests go to replica 0 (stopped, so they stay there)
        assert wait_for(lambda: [r["in_flight"] for r in replicas(d)][1] == 0 and
                        sum(r["in_flight"] for r in replicas(d)) == 12), replicas(d)
        os.kill(before[0], signal.SIGKILL)
        results = [f.result(timeout=WAIT) for f in futures]
    # every request answered, none with a 500: the dialect's 503 with a Retry-After the client can follow
    for dialect, (status, headers, body) in zip(dialects, results):
        assert status == 503, body
        assert int(headers["retry-after"]) >= 1
        if dialect == "systemone":
            assert body["detail"]["error_type"] == "unavailable_error", body
            message = body["detail"]["message"]
        else:
            assert list(body) == ["error"], body
            message = body["error"]
        # replica 1's requests died twice; replica 0's once, with no live worker left to go to
        assert re.search(r"died 2 times|no replica of basal-test-tiny is serving", message), message
    # while none is back: /health 503 `unavailable`, each replica `restarting` or `loading`, decisions 503 at once
    status, headers, health = http("GET", d.url + "/health")
    if status == 503:  # (a restart on an idle machine can be back within a second: then skip to the recovery)
        assert health["status"] == "unavailable" and "basal-test-tiny" in health["error"], health
        assert headers["retry-after"] == "5"
        assert {e["state"] for e in health["replicas"]} <= {"restarting", "loading", "ready"}, health
        assert any(e["exit_code"] == -9 for e in health["replicas"] if not e["alive"]), health
        t0 = time.perf_counter()
        status, headers, body = http("POST", d.url + "/v1/systemone", work[0])
        if status == 503:
            assert time.perf_counter() - t0 < 5.0  # refused at once, never waiting for a worker
            assert body["detail"]["error_type"] == "unavailable_error"
            assert int(headers["retry-after"]) >= 1
        _, _, ps = http("GET", d.url + "/api/ps")
        assert [r["replica"] for r in ps["models"][0]["replicas"]] == [0, 1]
        # /api/ps (basal-local ps) carries what /health says of a dead worker: its exit code, the wait
        dead = [r for r in ps["models"][0]["replicas"] if not r["alive"]]
        assert all(r.get("exit_code") == -9 for r in dead if r["state"] == "restarting"), ps
    # both back after their back-off (1 s + a load): new processes, counted as restarts, answering as before
    after = wait_all_ready(d)
    assert all(r["state"] == "ready" and r["restarts"] == 1 for r in after), after
    assert {r["pid"] for r in after}.isdisjoint(before.values())
    _, _, ps = http("GET", d.url + "/api/ps")
    assert [(r["state"], r["restarts"]) for r in ps["models"][0]["replicas"]] == [("ready", 1), ("ready", 1)]
    with ThreadPoolExecutor(12) as pool:
        again = list(pool.map(lambda b: http("POST", d.url + "/v1/systemone", b), work))
    for (status, _, out), want in zip(again, alone):
        assert status == 200, out
        assert close(out["answers"], want), (out, want)
    assert {r["replica"] for r in replicas(d) if r["batches"] > 0} == {0, 1}  # both compute again
    for replica in (0, 1):
        assert re.search(rf"replica {replica} of basal-test-tiny on cpu is out of rotation: its process ended "
                         r"\(exit code -9\); \d+ requests went to the others; restarting it in 1 s", d.log), d.log
        assert re.search(rf"replica {replica} of basal-test-tiny on cpu is back in rotation \(restart 1, pid \d+",
                         d.log), d.log[-3000:]
    assert "Traceback" not in d.log, d.log[-3000:]


def test_a_worker_that_dies_soon_after_its_restart_waits_longer(workers):
    d = workers
    wait_all_ready(d)
    victim = next(r["pid"] for r in replicas(d) if r["replica"] == 1)
    os.kill(victim, signal.SIGKILL)  # within a minute of its load: a quick death, the back-off doubles
    moved = wait_for(lambda: re.search(r"replica 1 of basal-test-tiny on cpu is out of rotation: its process ended "
                                       r"\(exit code -9\); 0 requests went to the others; restarting it in 2 s",
                                       d.log), 30, 0.1)
    assert moved, d.log[-3000:]
    # meanwhile the other worker serves every request: /health `degraded`, 200 answers
    status, _, health = http("GET", d.url + "/health")
    if health["status"] != "ok":  # not back yet
        assert status == 200 and health["status"] == "degraded", health
        assert [e["alive"] for e in health["replicas"]] == [True, False], health
    assert http("POST", d.url + "/v1/systemone", bodies(1)[0])[0] == 200
    after = wait_all_ready(d)
    assert [r["restarts"] for r in after] == [1, 2], after
    # `basal-local ps` lists each replica's state and restarts
    shown = cli_run(["ps", "--url", d.url], capture_output=True, text=True, timeout=60)
    assert shown.returncode == 0, shown.stderr
    assert re.search(r"replica 0: pid \d+ \(worker process\), cpu, ready \(restarts 1\)", shown.stdout), shown.stdout
    assert re.search(r"replica 1: pid \d+ \(worker process\), cpu, ready \(restarts 2\)", shown.stdout), shown.stdout


def test_the_dashboard_shows_each_replicas_state():
    """The models view (key 4) lists a model's replicas with their state once one is not ready."""
    from rich.console import Console

    from basal_local.tui.data import DashboardData
    from basal_local.tui.screens.models import models_renderable

    data = DashboardData(clock=lambda: 0.0)
    replicas = [{"replica": 0, "device": "cuda:0", "alive": True, "state": "ready"},
                {"replica": 1, "device": "cuda:1", "alive": False, "state": "restarting", "restarts": 2}]
    data.stats = {"models": [{"name": "m", "engine": {}, "calibration": {}, "replicas": replicas}]}
    console = Console(width=120, record=True)
    console.print(models_renderable(data))
    text = console.export_text()
    assert re.search(r"replica 0 +cuda:0 *\n", text) and re.search(r"replica 1 +cuda:1  \(restarting, restarts 2\)", text)
    data.stats["models"][0]["replicas"] = replicas[:1]  # one replica, ready: no line
    console = Console(width=120, record=True)
    console.print(models_renderable(data))
    assert "replica 0" not in console.export_text()


def test_the_back_off_doubles_per_quick_death_and_starts_over_after_a_stable_run(monkeypatch):
    from basal_local.replicas import restarts as mod

    monkeypatch.setattr(mod, "RESTART_FIRST_S", 0.01)
    monkeypatch.setattr(mod, "RESTART_MAX_S", 0.08)
    spawned, failing = [], [True]

    def spawn(slot: int) -> None:
        if failing[0]:
            failing[0] = False
            raise OSError("no process")  # the first try fails: tried again after the next back-off
        spawned.append(slot)

    r = mod.Restarts([0, 1], spawn, "m")
    assert r.schedule(0, None) is None  # not serving yet (the first load): no restart
    r.serving = True
    delays = [r.schedule(1, time.monotonic()) for _ in range(5)]  # five quick deaths in a row
    assert delays == [0.01, 0.02, 0.04, 0.08, 0.08]
    assert r.schedule(1, time.monotonic() - mod.STABLE_S) == 0.01  # it had served a while: start over
    # every timer spawned once, the failed one again after its back-off
    assert wait_for(lambda: spawned.count(1) == 6 and not r.at, 10, 0.01), (spawned, r.at)
    assert r.count[1] == 7
    assert r.retry_after_s([]) == 5 and r.retry_after_s([time.monotonic()]) == 1
    r.stop()
    assert r.schedule(0, None) is None

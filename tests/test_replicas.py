"""Several engine replicas of one model behind one endpoint (issue "Beyond one GPU", CPU part).

`--device cpu --replicas 2` runs two engines in one daemon; requests go to the replica with the least queued
packed tokens, answers equal the single engine's, and a replica whose device dies leaves the rotation with its
requests retried on the other one.
"""

from __future__ import annotations

import json
import os
import re
import signal
import sys
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from basal_local.api.answers import response_body
from basal_local.api.systemone import validate_systemone
from basal_local.backends.torch import TorchBackend
from basal_local.engine.engine import EngineSettings, ModelEngine
from basal_local.engine.gate import DeviceGate
from basal_local.model import load_model_dir
from basal_local.protocol.outcome import Outcome
from basal_local.replicas.inprocess import ReplicaSet
from basal_local.telemetry import Telemetry

from .conftest import Daemon, http

M = "basal-test-tiny"
WAIT = 60.0


def bodies(n: int) -> list[dict]:
    return [{"model": M, "state": f"Ticket {i}: the parcel {'is late' if i % 3 else 'arrived broken'}.",
             "questions": {"q": {"type": "choice", "criteria": {"a": "Damage", "b": "Delay", "c": None}},
                           "n": {"type": "noul", "instructions": f"Urgent #{i % 4}?"}}} for i in range(n)]


def probabilities(answer: dict) -> np.ndarray:
    return np.array([answer["n"]["noul"], *answer["q"]["probabilities"].values()])


def test_two_replicas_in_one_daemon_answer_like_one_and_share_the_work(daemon, tiny_model):
    replicated = Daemon(["--model", str(tiny_model), "--device", "cpu", "--replicas", "2"])
    try:
        replicated.wait_ready(timeout=240)
        _, _, health = http("GET", replicated.url + "/health")
        assert [(r["replica"], r["device"], r["alive"]) for r in health["replicas"]] == [(0, "cpu", True),
                                                                                          (1, "cpu", True)]
        work = bodies(24)
        alone = [http("POST", daemon.url + "/v1/systemone", b)[2]["answers"] for b in work]
        with ThreadPoolExecutor(24) as pool:
            together = list(pool.map(lambda b: http("POST", replicated.url + "/v1/systemone", b), work * 2))
        for i, (status, _, out) in enumerate(together):
            assert status == 200, out
            assert np.abs(probabilities(out["answers"]) - probabilities(alone[i % 24])).max() <= 1e-6
        _, _, stats = http("GET", replicated.url + "/api/stats")
        per_replica = {r["replica"]: r["batches"] for r in stats["replicas"]}
        assert per_replica[0] > 0 and per_replica[1] > 0, per_replica  # both computed
        assert {b["replica"] for b in stats["batches"]} == {0, 1}
    finally:
        replicated.stop()


class DyingBackend(TorchBackend):
    """The torch CPU backend, until `die` is set: then every forward raises like a lost device."""

    def __init__(self) -> None:
        super().__init__("cpu")
        self.die = threading.Event()
        self.poison_batches = threading.Event()  # batches (not the one-token probe) fail, the device works
        self.forwards = 0

    def forward(self, batch):
        if self.die.is_set():
            raise RuntimeError("CUDA error: device lost (simulated)")
        if self.poison_batches.is_set() and batch.num_tokens > 1:
            raise RuntimeError("this batch is poisoned (simulated)")
        self.forwards += 1
        return super().forward(batch)


@pytest.fixture
def replica_set(tiny_model):
    model = load_model_dir(tiny_model)
    engines = []
    for r in range(2):
        backend = DyingBackend()
        backend.load(tiny_model, "f32")
        engines.append(ModelEngine(model, backend, DeviceGate(), Telemetry(), EngineSettings(long_tokens=0),
                                   replica=r))
    replicas = ReplicaSet(engines)
    replicas.start()
    yield replicas
    replicas.stop(timeout=WAIT)


def plans(replicas: ReplicaSet, n: int):
    return [replicas.plan(validate_systemone(b, M)) for b in bodies(n)]


def test_a_dead_replica_leaves_the_rotation_and_nothing_is_lost(replica_set, tiny_model):
    own = TorchBackend("cpu")  # its own backend: an engine on a replica's backend would share that backend's pool
    own.load(tiny_model, "f32")
    reference = ModelEngine(replica_set.model, own, DeviceGate(), Telemetry(), EngineSettings(long_tokens=0))
    reference.start()
    try:
        expected = [response_body(reference.submit(p).result(WAIT), "systemone", 0.0)["answers"] for p in plans(replica_set, 16)]
    finally:
        reference.stop(WAIT)
    replica_set.replicas[1].backend.die.set()
    jobs = [replica_set.submit(p) for p in plans(replica_set, 16)]
    results = [job.result(WAIT) for job in jobs]
    assert all(isinstance(r, Outcome) for r in results)
    for got, want in zip(results, expected):
        assert np.abs(probabilities(response_body(got, "systemone", 0.0)["answers"]) - probabilities(want)).max() <= 1e-6
    assert replica_set.dead == {1}
    assert [r["alive"] for r in replica_set.describe()] == [True, False]
    assert replica_set.replicas[1].backend.forwards == 0
    # later work goes to the live replica only
    assert replica_set.submit(plans(replica_set, 1)[0]).result(WAIT)
    assert replica_set.replicas[1].batches == 0


def test_a_round_routed_to_a_replica_as_it_dies_goes_to_a_live_one(replica_set):
    """The moment between routing and queueing: the chosen replica died and drained its lanes (its jobs went
    elsewhere); a round that reaches it then is routed again, not failed with `EngineStopped`."""
    dying = replica_set.replicas[1]
    with replica_set._lock:
        replica_set.dead.add(1)
    for lane in dying.lanes():
        lane.drain()
    route, routed = replica_set._route, []

    def first_to_the_dying(plan):  # the first routing happened just before the replica died
        if routed:
            return route(plan)
        routed.append(plan)
        return dying, plan.prompt_specs(), None

    replica_set._route = first_to_the_dying
    outcome = replica_set.submit(plans(replica_set, 1)[0]).result(WAIT)
    assert isinstance(outcome, Outcome) and len(routed) == 1
    assert replica_set.replicas[0].batches == 1 and dying.batches == 0


def test_a_batch_that_fails_on_a_working_device_fails_alone(replica_set):
    replica_set.replicas[0].backend.poison_batches.set()
    replica_set.replicas[1].backend.poison_batches.set()
    job = replica_set.submit(plans(replica_set, 1)[0])
    with pytest.raises(RuntimeError, match="poisoned"):
        job.result(WAIT)
    assert replica_set.dead == set()  # the probe computed: the device is fine
    for engine in replica_set.replicas:
        engine.backend.poison_batches.clear()
    assert isinstance(replica_set.submit(plans(replica_set, 1)[0]).result(WAIT), Outcome)


def test_every_replica_dead_answers_unavailable(replica_set):
    from basal_local.engine.protocol import EngineUnavailable

    for engine in replica_set.replicas:
        engine.backend.die.set()
    job = replica_set.submit(plans(replica_set, 1)[0])
    with pytest.raises(RuntimeError):  # the last replica keeps the error: nowhere left to retry
        job.result(WAIT)
    # whichever replica ran it first died; once both are out, new work is refused at once
    follow = [replica_set.submit(p) for p in plans(replica_set, 2)]
    for f in follow:  # the server's 503 + Retry-After (app.py), not the 500 "engine stopped" of a shutdown
        with pytest.raises(EngineUnavailable, match="no replica of basal-test-tiny is serving") as caught:
            f.result(WAIT)
        assert caught.value.retry_after_s >= 1
    assert [r["alive"] for r in replica_set.describe()] == [False, False]


# ---- replicas in worker processes (`--replica-processes`): one daemon for the three tests below, in order

def special_bodies() -> list[dict]:
    """A large choice (two rounds, run inside the worker), evidence (the worker's forward) and a fixed answer."""
    return [{"model": M, "state": "Paczka dotarła uszkodzona, klient czeka od tygodnia.", "questions": {
                "big": {"type": "choice", "criteria": [f"opcja {i}" for i in range(14)]},
                "kind": {"type": "choice", "instructions": "Rodzaj?", "criteria": {"damage": "Uszkodzenie",
                                                                                     "late": None},
                         "evidence": True}}},
            {"model": M, "state": "The refund request is for a broken kettle.", "questions": {
                "refund": {"type": "act", "instructions": "Refund?", "max_error": 0.05,
                           "costs": {"approve": {"true": 0, "false": 1240}, "reject": {"true": 300, "false": 0}}}}},
            {"model": M, "state": "x" * 40000, "questions": {"q": {"type": "noul", "instructions": "Long?"}}}]


@pytest.fixture(scope="module")
def processes(tiny_model):
    d = Daemon(["--model", str(tiny_model), "--device", "cpu", "--replicas", "2", "--replica-processes",
                "--metrics"])
    try:
        d.wait_ready(timeout=240)
        yield d
    finally:
        d.stop()


def children(pid: int) -> list[int]:
    """Every live process descended from `pid` (Linux /proc): the workers are children of multiprocessing's
    forkserver, itself a child of the daemon."""
    parents: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as fh:
                    fields = fh.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if fields[0] != "Z":
                parents[int(entry)] = int(fields[1])
    out, frontier = [], [pid]
    while frontier:
        kids = [child for child, parent in parents.items() if parent in frontier]
        out += kids
        frontier = kids
    return out


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def close(got, want, tol: float = 1e-6) -> bool:
    """The same answer: the same keys, choices and texts, numbers within `tol` (the CPU path is not
    batch-invariant: a question's floats depend on its batch-mates by ~1e-7; the CUDA path's are bitwise)."""
    if isinstance(want, dict):
        return isinstance(got, dict) and list(got) == list(want) and all(close(got[k], want[k], tol) for k in want)
    if isinstance(want, list):
        return isinstance(got, list) and len(got) == len(want) and all(close(g, w, tol) for g, w in zip(got, want))
    if isinstance(want, float):
        return isinstance(got, float) and abs(got - want) <= tol
    return got == want


def test_replica_processes_answer_like_one_daemon_and_share_the_work(processes, daemon):
    work = bodies(16) + special_bodies()
    alone = [http("POST", daemon.url + "/v1/systemone", b) for b in work]
    # the act refuses on this model (422 from the answer, in the worker); the long state is refused by planning
    assert [status for status, _, _ in alone] == [200] * (len(work) - 2) + [422, 422], alone
    assert "evidence" in alone[-3][2]["answers"]["kind"]
    with ThreadPoolExecutor(16) as pool:
        together = list(pool.map(lambda b: http("POST", processes.url + "/v1/systemone", b), work * 2))
    for i, (status, headers, out) in enumerate(together):
        want_status, _, want = alone[i % len(work)]
        assert status == want_status, (out, want)
        if status != 200:  # the same error body
            assert out == want
            continue
        assert close(out["answers"], want["answers"]), (out, want)
        assert out["usage"]["input_tokens"] == want["usage"]["input_tokens"]
        assert int(headers["x-basal-batch-requests"]) >= 1
    _, _, health = http("GET", processes.url + "/health")
    assert [(r["replica"], r["device"], r["alive"]) for r in health["replicas"]] == [(0, "cpu", True),
                                                                                      (1, "cpu", True)]
    _, _, stats = http("GET", processes.url + "/api/stats")
    pids = {r["pid"] for r in stats["replicas"]}
    assert len(pids) == 2 and processes.proc.pid not in pids and set(children(processes.proc.pid)) >= pids
    assert all(r["batches"] > 0 for r in stats["replicas"]), stats["replicas"]  # both computed
    # the workers' batches are the daemon's records: unique ids, both lanes, answered requests point at them
    ids = [b["batch_id"] for b in stats["batches"]]
    assert len(set(ids)) == len(ids) and {b["replica"] for b in stats["batches"]} == {0, 1}
    assert {b["lane"] for b in stats["batches"]} == {"main", "main-r1"}
    assert stats["totals"]["answered"] == len(together) - 4
    assert any(b["tree"] for b in stats["batches"])  # a batch tree, built in its worker when read
    # the dashboard's stream carries the workers' events (replayed from the start of the history)
    wanted = {(kind, lane) for kind in ("queued", "batched", "computed") for lane in ("main", "main-r1")}
    with urllib.request.urlopen(processes.url + "/api/events?since=0", timeout=30) as stream:
        for line in stream:
            if line.startswith(b"data: "):
                event = json.loads(line[6:])
                wanted.discard((event["kind"], event.get("lane")))
                if not wanted:
                    break
    assert not wanted
    with urllib.request.urlopen(processes.url + "/metrics", timeout=30) as resp:
        metrics = resp.read().decode()
    assert 'basal_batch_requests_count{lane="main-r1",model="basal-test-tiny"}' in metrics
    # each worker's state cache (its own counters, relayed with its batches) and the model's sum of them
    caches = [r["prefix_cache"] for r in stats["models"][0]["replicas"]]
    assert all(c["enabled"] and c["budget_bytes"] > 0 and c["pinned"] >= 1 for c in caches), caches
    total = stats["models"][0]["prefix_cache"]
    assert total["enabled"] and total["budget_bytes"] == sum(c["budget_bytes"] for c in caches) > 0
    assert total["hits"] + total["misses"] >= len(together) - 4  # every answered request counted by its worker
    budget = re.search(r'basal_prefix_cache_budget_bytes\{model="basal-test-tiny",replica="1"\} (\S+)', metrics)
    assert budget and float(budget.group(1)) == caches[1]["budget_bytes"]


def test_a_killed_replica_process_loses_nothing(processes, daemon):
    work = bodies(32)
    alone = [http("POST", daemon.url + "/v1/systemone", b)[2]["answers"] for b in work]
    _, _, stats = http("GET", processes.url + "/api/stats")
    victim = next(r["pid"] for r in stats["replicas"] if r["replica"] == 1)
    # Kill it while it holds requests: stop it first, so that whatever the router gives it stays unanswered
    # (a tiny-model request is done in milliseconds, so catching a running worker with work in hand was a race
    # on a loaded machine), wait until it holds some, then kill it.
    os.kill(victim, signal.SIGSTOP)
    with ThreadPoolExecutor(20) as pool:
        futures = [pool.submit(http, "POST", processes.url + "/v1/systemone", b) for b in work]
        deadline = time.time() + 60
        while time.time() < deadline:
            _, _, stats = http("GET", processes.url + "/api/stats")
            if stats["replicas"][1]["in_flight"] >= 1:
                break
            time.sleep(0.02)
        os.kill(victim, signal.SIGKILL)
        results = [f.result() for f in futures]
    for (status, _, out), want in zip(results, alone):
        assert status == 200, out
        assert close(out["answers"], want), (out, want)
    deadline = time.time() + 10  # its pipe's end is seen at once, but the reader thread may not have run yet
    while True:
        _, _, health = http("GET", processes.url + "/health")
        if [r["alive"] for r in health["replicas"]] == [True, False] or time.time() > deadline:
            break
        time.sleep(0.05)
    assert [r["alive"] for r in health["replicas"]] == [True, False]
    # the line is written once the process is reaped, after its requests moved (a forkserver child's exit status
    # comes through the forkserver: 10 s were not always enough on a loaded 2-core machine, 2 of 7 runs)
    deadline = time.time() + 30
    while True:
        moved = re.search(r"replica 1 of \S+ on cpu is out of rotation: its process ended \(exit code -9\); "
                          r"(\d+) requests went to the others", processes.log)
        if moved or time.time() > deadline:
            break
        time.sleep(0.1)
    assert moved and int(moved[1]) >= 1, processes.log[-3000:]  # it died holding requests, and they were answered
    assert close(http("POST", processes.url + "/v1/systemone", work[0])[2]["answers"], alone[0])  # the survivor


def test_stopping_the_daemon_leaves_no_replica_process(processes):
    kids = children(processes.proc.pid)
    assert kids  # the live worker (and multiprocessing's resource tracker)
    processes.stop()
    assert processes.proc.returncode == 0, processes.log[-2000:]
    deadline = time.time() + 30  # seconds on a loaded machine
    while time.time() < deadline and any(alive(pid) for pid in kids):
        time.sleep(0.1)
    left = [pid for pid in kids if alive(pid)]
    assert not left, [(pid, _cmdline(pid)) for pid in left]  # which process outlived the daemon, and what it is


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as fh:
            return fh.read().replace(b"\0", b" ").decode(errors="replace")[:300]
    except OSError:
        return "?"


def test_replica_processes_are_the_default_for_a_model_on_several_gpus_only():
    from basal_local.server.daemon import use_processes
    from basal_local.server.settings import Settings

    auto, on, off = Settings(), Settings(replica_processes=True), Settings(replica_processes=False)
    assert use_processes(auto, ["cuda:0", "cuda:1"]) and not use_processes(off, ["cuda:0", "cuda:1"])
    assert not use_processes(auto, ["cpu"]) and not use_processes(auto, ["cuda:1"]) and use_processes(on, ["cpu"])


def test_a_lost_replica_is_announced_once_even_when_a_send_saw_it_first(caplog):
    """The "out of rotation" line (what an operator and the killed-replica test read) is written once per replica
    that had joined the rotation, also when a failed send marked it not alive before its reader saw the pipe close
    (the race behind that test's missing line in 2 of 9 loaded runs); a replica that never became ready is not
    announced."""
    import logging
    from types import SimpleNamespace

    from basal_local.replicas.front import ProcessReplicaSet

    owner = object.__new__(ProcessReplicaSet)  # only what `lost` touches: no worker processes
    owner._lock, owner.dead, owner.stopping = threading.Lock(), set(), False
    owner.model = SimpleNamespace(name="m")
    owner._dispatch = lambda pending: None
    owner.restarts = SimpleNamespace(exit_codes={}, schedule=lambda slot, ready_at: None)  # not serving: none

    def replica(number: int, ready: bool):
        return SimpleNamespace(replica=number, info=SimpleNamespace(pid=1) if ready else None, alive=False,
                               pending={}, queued=0, running_ids=set(), device="cpu", lost_seen=False,
                               ready_at=None, load_error=None,
                               process=SimpleNamespace(join=lambda timeout: None, exitcode=-9))

    seen, never_ready = replica(1, True), replica(2, False)  # `alive` already False: a send failed first
    with caplog.at_level(logging.ERROR, logger="basal_local"):
        owner.lost(seen)
        owner.lost(seen)  # a second report of the same loss
        owner.lost(never_ready)
    lines = [r.getMessage() for r in caplog.records if "out of rotation" in r.getMessage()]
    assert lines == ["replica 1 of m on cpu is out of rotation: its process ended (exit code -9); 0 requests went "
                     "to the others"]
    assert owner.dead == {1, 2}


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the forkserver and /proc are Linux's")
def test_the_worker_forkserver_never_runs_with_sigint_deliverable():
    """Ctrl-C to the group in the forkserver's first ~50 ms (its interpreter start, before `shield` ignores SIGINT)
    killed it with a traceback. It now starts with SIGINT blocked: from its first moment SIGINT is blocked or
    ignored, and once `shield` ran, ignored and no longer blocked (its workers inherit a plain mask)."""
    from multiprocessing import forkserver

    from basal_local.replicas.start import end_forkserver, start_context

    def masks(pid: int) -> tuple[int, int]:
        with open(f"/proc/{pid}/status") as fh:
            fields = dict(line.split(":", 1) for line in fh)
        return int(fields["SigBlk"], 16), int(fields["SigIgn"], 16)

    bit = 1 << (signal.SIGINT - 1)
    end_forkserver()
    start_context()
    pid = forkserver._forkserver._forkserver_pid
    try:
        seen = []
        deadline = time.time() + 60
        while time.time() < deadline:
            blocked, ignored = masks(pid)
            seen.append((bool(blocked & bit), bool(ignored & bit)))
            if ignored & bit and not blocked & bit:
                break
            time.sleep(0.001)
        assert all(b or i for b, i in seen), seen
        assert seen[-1] == (False, True), seen
    finally:
        end_forkserver()  # not reaped here: multiprocessing reaps it when it starts the next one


def test_ctrl_c_to_the_group_while_the_worker_forkserver_imports_stops_cleanly(tiny_model, tmp_path):
    """Ctrl-C in a terminal reaches the whole process group, the worker forkserver too; while it imported torch
    (before multiprocessing shields it) it died with a traceback and the daemon said "loading failed". Now the
    daemon alone handles it: exit 0, no traceback, nothing left in the group."""
    import subprocess
    import sys

    proc = subprocess.Popen([sys.executable, "-m", "basal_local.cli", "serve", "--model", str(tiny_model), "--device",
                             "cpu", "--replicas", "2", "--replica-processes", "--port", "0"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
                            env={**os.environ, "BASAL_LOCAL_HOME": str(tmp_path)})

    def forkserver_started() -> bool:
        for entry in os.listdir("/proc"):
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as fh:
                    cmd = fh.read()
                with open(f"/proc/{entry}/stat") as fh:
                    parent = int(fh.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            if parent == proc.pid and b"multiprocessing.forkserver" in cmd:
                return True
        return False

    deadline = time.time() + 60
    while not forkserver_started() and time.time() < deadline and proc.poll() is None:
        time.sleep(0.01)
    time.sleep(0.5)  # inside its torch import (the interpreter start before it: the test above)
    os.killpg(proc.pid, signal.SIGINT)  # as a terminal's Ctrl-C: the daemon and every process of its group
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, out
    assert "Traceback" not in out and "loading failed" not in out and "Fatal Python" not in out, out
    deadline = time.time() + 15
    while time.time() < deadline:
        try:
            os.killpg(proc.pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.1)
    else:
        raise AssertionError("processes of the daemon's group outlived it")


@pytest.mark.parametrize("sigterms, backlog", [(1, 0), (2, 0), (1, 40)])
def test_sigterm_stops_a_daemon_whose_worker_is_stopped(tiny_model, tmp_path, sigterms, backlog):
    """A worker that does not answer (SIGSTOPped) held the stop for the whole 30 s wait, and a second SIGTERM then
    killed the daemon (-15), leaving the forkserver, the resource tracker and the worker behind. Now the stop
    continues a stopped worker (it drains and ends), and a second signal kills the workers still running: exit 0
    within seconds either way, nothing alive left in the group. `backlog`: requests about a long document sent to
    the stopped worker first, until its pipe is full (the stop's own message to it then blocked the stop for good)."""
    import subprocess

    from .conftest import free_port

    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "basal_local.cli", "serve", "--model", str(tiny_model), "--device",
                             "cpu", "--replicas", "2", "--replica-processes", "--port", str(port)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
                            env={**os.environ, "BASAL_LOCAL_HOME": str(tmp_path)})
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.time() + 120
        while time.time() < deadline:
            try:
                with urllib.request.urlopen(url + "/health", timeout=2) as resp:
                    if json.load(resp)["status"] == "ok":
                        break
            except OSError:
                time.sleep(0.2)
        with urllib.request.urlopen(url + "/api/ps", timeout=10) as resp:
            hung = json.load(resp)["models"][0]["replicas"][0]["pid"]
        os.kill(hung, signal.SIGSTOP)
        if backlog:
            from .test_prefix_cache import body, document

            data = json.dumps(body(document(7, words=2000), 1)).encode()

            def ask():
                try:
                    urllib.request.urlopen(urllib.request.Request(url + "/v1/systemone", data, {
                        "Content-Type": "application/json"}), timeout=120).read()
                except OSError:  # answered at the stop, or not at all
                    pass

            for _ in range(backlog):
                threading.Thread(target=ask, daemon=True).start()
            time.sleep(3.0)  # the requests planned and sent: the stopped worker's pipe fills
        started = time.time()
        proc.send_signal(signal.SIGTERM)
        if sigterms == 2:
            time.sleep(1.0)
            proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=90)
        assert proc.returncode == 0 and time.time() - started < (30 if backlog else 15), (proc.returncode, out)
        assert "Traceback" not in out and "basal-local: stopped" in out, out
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    deadline = time.time() + 15
    alive: list[str] = []
    while time.time() < deadline:
        alive = []
        for entry in os.listdir("/proc"):
            try:
                with open(f"/proc/{entry}/stat") as fh:
                    fields = fh.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[3]) == proc.pid and fields[0] != "Z":  # the group's, not a zombie
                alive.append(entry)
        if not alive:
            break
        time.sleep(0.2)
    assert not alive, f"processes of the daemon's group outlived it: {alive}"

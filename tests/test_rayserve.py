"""`basal-local serve --ray` (issue "Beyond one GPU", several hosts): the daemon's app with Ray engines.

The first tests need no Ray: `RayEngine` implements the Engine protocol over a deployment handle (here a fake that
calls a real `EngineReplica` in this process), so the server answers, errors and stats through it as through any
engine; a request whose replica died is sent to another one, and when every try was lost the answer is the
dialect's 503. The last test starts a local Ray cluster with two CPU replicas through the real command (skipped
where Ray is not installed).
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
from litestar.testing import TestClient

from basal_local.engine.protocol import Engine
from basal_local.model.directory import load_model_dir
from basal_local.replicas.rayengine import RETRIES, RayEngine
from basal_local.replicas.rayreplica import EngineReplica
from basal_local.server.app import create_app
from basal_local.server.security import AccessPolicy, Guard
from basal_local.server.settings import Settings
from basal_local.server.state import AppState
from basal_local.telemetry import Telemetry

from .conftest import cli_run, free_port, http
from .test_replicas import bodies, probabilities  # the same requests as the one-host test


def rayserve():
    """basal_local.server.rayserve, imported where a test uses it (it loads the daemon's server)."""
    from basal_local.server import rayserve

    return rayserve


class _Broadcast:
    def __init__(self, results: list) -> None:
        self._results = results

    def results(self, timeout_s=None, return_exceptions=False):
        return self._results


class FakeHandle:
    """A stand-in for the deployment's handle: `submit.remote(model, data)` (awaitable) runs on the replicas in
    turn (as Ray's router spreads calls), `broadcast(method, ...)` asks each; the first `deaths` calls die before
    answering with `died`."""

    def __init__(self, replicas: list, deaths: int = 0, died: type[BaseException] | None = None) -> None:
        self.replicas, self.deaths, self.died = replicas, deaths, died
        self.calls = 0
        self.submit = self

    def remote(self, model: str, data: bytes):
        self.calls += 1
        n = self.calls

        async def call():
            if n <= self.deaths:
                raise self.died()
            return await self.replicas[n % len(self.replicas)].submit(model, data)

        return call()

    def broadcast(self, method: str, *args):
        return _Broadcast([getattr(r, method)(*args) for r in self.replicas])


@pytest.fixture(scope="module")
def settings():
    return Settings.load({"device": "cpu"}, config_file=Path("/nonexistent"))


@pytest.fixture(scope="module")
def replicas(tiny_model, settings):
    """Two engine replicas as the deployment builds them (rayserve.replica_spec), in this process."""
    spec = rayserve().replica_spec(settings, [str(tiny_model)])
    made = [EngineReplica(spec), EngineReplica(spec)]
    yield made
    for replica in made:
        replica.close()


def served(engine: RayEngine, settings: Settings) -> TestClient:
    state = AppState(engines={engine.model.name: engine}, default_model=engine.model.name, ready=True,
                     backend_name="torch", device="cpu", dtype="f32", telemetry=engine.telemetry, metrics=True)
    policy = AccessPolicy.build(settings.host, settings.api_key, settings.allowed_hosts, settings.allowed_origins)
    return TestClient(Guard(create_app(state), policy), base_url="http://127.0.0.1:8000")


def ray_engine(tiny_model, handle, settings) -> RayEngine:
    return RayEngine(load_model_dir(tiny_model), handle, Telemetry(), settings.engine, poll_s=0)


def test_the_ray_engine_implements_the_protocol_and_answers_like_the_daemon(daemon, tiny_model, replicas, settings):
    engine = ray_engine(tiny_model, FakeHandle(replicas), settings)
    assert isinstance(engine, Engine)
    try:
        engine.poll()  # the replicas' first reports: both listed before any request
        assert [(r["replica"], r["alive"]) for r in engine.describe()] == [(0, True), (1, True)]
        with served(engine, settings) as client:
            for path in ("/v1/systemone", "/v1/basal"):
                for body in bodies(4):
                    got = client.post(path, json=body, headers={"x-request-id": "rid-1"})
                    want_status, want_headers, want = http("POST", daemon.url + path, body,
                                                           headers={"x-request-id": "rid-1"})
                    assert got.status_code == want_status == 200, got.text
                    answers = got.json()["answers"]
                    assert np.abs(probabilities(answers) - probabilities(want["answers"])).max() <= 1e-6
                    assert got.headers["x-request-id"] == got.headers["x-typesafe-request-id"] == "rid-1"
                    same = {k.lower() for k in want_headers} - {"date", "server", "content-length", "connection"}
                    assert same - set(got.headers) == set(), same - set(got.headers)  # every header the daemon sends
            # errors come from the daemon's own handlers and guards, in each dialect's shape
            for path, raw, extra in [("/v1/systemone", b"{not json", {}), ("/v1/basal", b'{"state": 3}', {}),
                                     ("/v1/systemone", b"{}", {"origin": "https://evil.example"}),
                                     ("/v1/nothing", b"{}", {})]:
                got = client.post(path, content=raw, headers={"content-type": "application/json", **extra})
                want_status, _, want = http("POST", daemon.url + path, raw,
                                            headers={"content-type": "application/json", **extra})
                assert (got.status_code, got.json()) == (want_status, want)
                assert got.status_code in (400, 403, 404, 422)
            engine.poll()  # the replicas' reports after their last batch (an answer may beat its batch's count)
            stats = client.get("/api/stats").json()
            health = client.get("/health").json()
            metrics = client.get("/metrics")
        # both replicas computed, and the front's telemetry saw their batches
        assert len(stats["replicas"]) == 2 and all(r["batches"] > 0 for r in stats["replicas"]), stats["replicas"]
        assert {r["ray_replica"] for r in stats["replicas"]} == {r.replica_id for r in replicas}
        assert len(stats["requests"]) >= 8 and len(stats["batches"]) >= 2
        assert all(b["tree"] for b in stats["batches"]), stats["batches"][0]  # asked of the replica that ran it
        assert stats["counters"].get("batches", 0) >= 2, stats["counters"]
        assert health["status"] == "ok" and [r["alive"] for r in health["replicas"]] == [True, True]
        assert metrics.status_code == 200 and 'replica="1"' in metrics.text, metrics.text[:2000]
    finally:
        assert engine.stop(5.0)


def test_the_ray_engine_retries_a_request_whose_replica_died(tiny_model, replicas, settings):
    ray_exceptions = pytest.importorskip("ray.exceptions", reason="Ray is not installed (pip install '.[ray]')")
    died = ray_exceptions.ActorDiedError
    body = bodies(1)[0]
    handle = FakeHandle(replicas, deaths=RETRIES, died=died)
    engine = ray_engine(tiny_model, handle, settings)
    try:
        with served(engine, settings) as client:
            got = client.post("/v1/basal", json=body)
        assert got.status_code == 200, got.text
        assert handle.calls == RETRIES + 1  # three replicas died, the fourth try answered
    finally:
        engine.stop(5.0)
    # every try dies: a 503 in the path's dialect, never a traceback
    for path in ("/v1/systemone", "/v1/basal"):
        handle = FakeHandle(replicas, deaths=99, died=died)
        engine = ray_engine(tiny_model, handle, settings)
        try:
            with served(engine, settings) as client:
                got = client.post(path, json=body)
        finally:
            engine.stop(5.0)
        assert got.status_code == 503 and handle.calls == RETRIES + 1, got.text
        assert got.headers["retry-after"] == "1"
        assert "Traceback" not in got.text
        if path == "/v1/systemone":
            assert got.json()["detail"]["error_type"] == "unavailable_error"
    # any other failure is not retried (it would fail again): the request fails once, as a 500
    handle = FakeHandle(replicas, deaths=1, died=ValueError)
    engine = ray_engine(tiny_model, handle, settings)
    try:
        with served(engine, settings) as client:
            got = client.post("/v1/basal", json=body)
    finally:
        engine.stop(5.0)
    assert got.status_code == 500 and handle.calls == 1 and "Traceback" not in got.text


def test_a_client_that_left_cancels_its_call(tiny_model, replicas, settings):
    """The future fails with Cancelled once the request's flag says its client went away, and the call in flight
    is cancelled (on Ray: the replica's task, whose lane then drops the job)."""
    from basal_local.api.basal import validate_basal
    from basal_local.engine.scheduler import Cancelled

    cancelled = threading.Event()

    class Slow(FakeHandle):
        def remote(self, model, data):
            self.calls += 1

            async def never():
                try:
                    await asyncio.Event().wait()
                except asyncio.CancelledError:
                    cancelled.set()
                    raise

            return never()

    engine = ray_engine(tiny_model, Slow(replicas), settings)
    try:
        plan = engine.plan(validate_basal(bodies(1)[0], engine.model.name))
        gone = threading.Event()
        future = engine.submit(plan, gone.is_set, "r")
        time.sleep(0.3)
        assert not future.done()
        gone.set()
        with pytest.raises(Cancelled):
            future.result(timeout=5)
        assert cancelled.wait(5)
    finally:
        engine.stop(5.0)


def test_ray_flags_need_ray_and_the_ray_mode_refuses_one_host_flags(tiny_model):
    def cli(*args):
        return cli_run(["serve", "--model", str(tiny_model), *args],
                              capture_output=True, text=True, timeout=60)

    out = cli("--min-replicas", "2")
    assert out.returncode == 2 and "--min-replicas only works with --ray" in out.stderr
    assert "Traceback" not in out.stderr
    out = cli("--ray", "--replicas", "2")  # flags are checked before Ray is imported
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert "--replicas does not go with --ray" in out.stderr
    try:
        import ray  # noqa: F401
    except ImportError:  # without the extra, --ray alone says how to get it (with it, it would start a cluster)
        out = cli("--ray")
        assert out.returncode != 0 and "Traceback" not in out.stderr
        assert "not installed" in out.stderr and "basal-local[ray]" in out.stderr


def test_a_ray_that_is_installed_but_does_not_import_is_a_user_error(tmp_path, monkeypatch):
    """What the GPU host showed: Ray Serve's grpcio-reflection refuses an older grpcio with a RuntimeError at import
    time; `serve --ray` says so in two lines with the fix, not as an internal error."""
    import argparse

    from basal_local.commands import UserError
    from basal_local.commands.serving import check_ray_flags

    fake = tmp_path / "ray"
    fake.mkdir()
    (fake / "__init__.py").write_text('raise RuntimeError("The grpc package installed is at version 1.84.0, but the '
                                      'generated code depends on grpcio>=1.85.1.\\nPlease upgrade")\n')
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in [m for m in sys.modules if m == "ray" or m.startswith("ray.")]:
        monkeypatch.delitem(sys.modules, name)
    args = argparse.Namespace(ray_address=None, min_replicas=None, max_replicas=None, devices=None, replicas=None,
                              replica_processes=None, tui=False, demo_traffic=False)
    with pytest.raises(UserError) as caught:
        check_ray_flags(args, ray_mode=True)
    lines = caught.value.lines()
    assert lines == ["basal-local: error: Ray Serve is installed here but does not import: The grpc package installed "
                     "is at version 1.84.0, but the generated code depends on grpcio>=1.85.1.",
                     '  reinstall it with its dependencies: pip install -U "basal-local[ray]"']


# ---------------------------------------------------------------- a real local Ray cluster

def _descendants(root: int) -> dict[int, str]:
    """pid -> command line of every process below `root` (from /proc)."""
    children: dict[int, list[int]] = {}
    cmdlines: dict[int, str] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as fh:
                ppid = int(fh.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{entry}/cmdline", "rb") as fh:
                cmdlines[int(entry)] = fh.read().replace(b"\0", b" ").decode(errors="replace")
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(entry))
    out, todo = {}, [root]
    while todo:
        for child in children.get(todo.pop(), []):
            out[child] = cmdlines.get(child, "")
            todo.append(child)
    return out


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie has ended
    except (OSError, IndexError):
        return False


def quiet_port() -> int:
    """A free port below the kernel's ephemeral range and above Ray's worker ports (10002-19999): Ray's own
    processes bind ephemeral ports while the cluster starts, and one of them took the port `free_port()` had just
    handed out before Ray's proxy bound it (`Address already in use`)."""
    import random
    import socket

    for _ in range(200):
        port = random.randint(20000, 32000)
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    return free_port()


class RayDaemon:
    """`basal-local serve --ray` as a subprocess; stop() ends it and every process seen below it."""

    def __init__(self, args: list[str]) -> None:
        self.port = quiet_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.lines: list[str] = []
        self.proc = subprocess.Popen([sys.executable, "-m", "basal_local.cli", "serve", "--ray", "--port",
                                      str(self.port), *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, env={**os.environ, "RAY_AUTH_MODE": "disabled"})
        self.tree: dict[int, str] = {}
        threading.Thread(target=lambda: self.lines.extend(self.proc.stdout), daemon=True).start()

    def wait_ready(self, timeout: float) -> None:
        deadline = time.time() + timeout
        while time.time() < deadline:
            self.tree.update(_descendants(self.proc.pid))
            if self.proc.poll() is not None:
                raise RuntimeError("serve --ray exited:\n" + "".join(self.lines)[-3000:])
            if any("ready through Ray Serve" in line for line in self.lines):
                try:
                    if http("GET", self.url + "/health", timeout=10)[0] == 200:
                        return
                except OSError:
                    pass
            time.sleep(0.5)
        raise TimeoutError("serve --ray was not ready in time:\n" + "".join(self.lines)[-3000:])

    def engine_pids(self) -> list[int]:
        return [pid for pid, cmd in _descendants(self.proc.pid).items() if "BasalEngine" in cmd]

    def stop(self) -> str:
        self.tree.update(_descendants(self.proc.pid))
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        time.sleep(1)
        for pid in self.tree:  # anything of this cluster that outlived it (only the pids seen below it)
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        return "".join(self.lines)


def _post(url: str, body: dict):
    status, _, out = http("POST", url, body, timeout=120)
    return status, out


def _ray_replicas(url: str) -> dict[str, dict]:
    """Ray's replica id -> the daemon's /api/stats entry for it."""
    return {r["ray_replica"]: r for r in http("GET", url + "/api/stats", timeout=30)[2]["replicas"]}


def test_two_ray_replicas_answer_like_the_daemon_share_the_work_and_survive_a_killed_one(daemon, tiny_model):
    pytest.importorskip("ray.serve", reason="Ray Serve is not installed (pip install '.[ray]')")
    started = time.monotonic()
    served = RayDaemon(["--model", str(tiny_model), "--device", "cpu", "--min-replicas", "2"])
    try:
        served.wait_ready(timeout=300)
        ready_s = time.monotonic() - started
        work = bodies(16)
        want = {path: [http("POST", daemon.url + path, b)[2]["answers"] for b in work]
                for path in ("/v1/systemone", "/v1/basal")}
        jobs = [(path, i) for path in want for i in range(len(work))] * 2
        with ThreadPoolExecutor(16) as pool:
            got = list(pool.map(lambda job: _post(served.url + job[0], work[job[1]]), jobs))
        for (path, i), (status, out) in zip(jobs, got):
            assert status == 200, out
            assert np.abs(probabilities(out["answers"]) - probabilities(want[path][i])).max() <= 1e-6
        # both replicas computed (the daemon's /api/stats lists the deployment's replicas)
        deadline = time.monotonic() + 10
        while len(seen := _ray_replicas(served.url)) < 2 and time.monotonic() < deadline:
            time.sleep(0.5)
        assert len(seen) == 2 and all(r["batches"] > 0 and r["alive"] for r in seen.values()), seen
        # kill one engine replica's process while requests are in flight: every request is still answered
        victims = served.engine_pids()
        assert len(victims) == 2, victims
        assert sorted(victims) == sorted(r["pid"] for r in seen.values())
        with ThreadPoolExecutor(16) as pool:
            futures = [pool.submit(_post, served.url + path, work[i]) for path, i in jobs]
            time.sleep(0.3)
            os.kill(victims[0], signal.SIGKILL)
            results = [f.result() for f in futures]
        for (path, i), (status, out) in zip(jobs, results):
            assert status == 200, out
            assert np.abs(probabilities(out["answers"]) - probabilities(want[path][i])).max() <= 1e-6
        # Ray Serve replaces the dead replica: a replica not seen before shows in /api/stats and computes
        deadline = time.monotonic() + 150
        fresh: set[str] = set()
        while time.monotonic() < deadline and not fresh:
            with ThreadPoolExecutor(8) as pool:
                list(pool.map(lambda b: _post(served.url + "/v1/basal", b), work[:8]))
            fresh = {rid for rid, r in _ray_replicas(served.url).items() if r["alive"] and r["batches"]} - set(seen)
            time.sleep(1)
        assert fresh, "the killed replica was not replaced"
        health = http("GET", served.url + "/health")[2]
        assert health["status"] in ("ok", "degraded"), health
        print(f"ray: ready after {ready_s:.1f} s, whole test {time.monotonic() - started:.1f} s")
    finally:
        log = served.stop()
    assert served.proc.returncode == 0, log[-3000:]
    assert "Traceback" not in log, log[-3000:]
    left = [pid for pid in served.tree if _alive(pid)]
    assert not left, f"Ray processes outlived the command: {left}"

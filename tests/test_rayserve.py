"""`basal-local serve --ray` (issue "Beyond one GPU", several hosts): the daemon's app on Ray Serve replicas.

The first tests need no Ray: an engine replica runs the daemon's own guarded app, so its answers, errors and
headers are the daemon's; the front retries a request whose replica died. The last test starts a local Ray
cluster with two CPU replicas through the real command (skipped where Ray is not installed).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import pytest

from basal_local.server.settings import Settings

from .conftest import cli_run, free_port, http
from .test_replicas import bodies, probabilities  # the same requests as the one-host test

if TYPE_CHECKING:
    from basal_local.server.rayserve import EngineReplica, Front


def rayserve():
    """basal_local.server.rayserve, imported where a test uses it: it loads litestar and the daemon (~1.5 s of CPU),
    and every test worker collects this file."""
    from basal_local.server import rayserve

    return rayserve


def scope(path: str, body: bytes, headers: dict[str, str] | None = None, method: str = "POST") -> dict:
    raw = [(b"host", b"127.0.0.1:8000"), (b"content-type", b"application/json"),
           (b"content-length", str(len(body)).encode())]
    raw += [(k.encode(), v.encode()) for k, v in (headers or {}).items()]
    return {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": method, "scheme": "http",
            "path": path, "raw_path": path.encode(), "query_string": b"", "root_path": "", "headers": raw,
            "client": ("127.0.0.1", 5000), "server": ("127.0.0.1", 8000)}


def run_exchange(replica: EngineReplica, path: str, body: bytes, headers: dict | None = None):
    """(status, headers, parsed body) of one exchange through the replica's generator."""

    async def go():
        return [m async for m in replica.exchange(scope(path, body, headers), body)]

    messages = asyncio.run(go())
    start = messages[0]
    assert start["type"] == "http.response.start" and all(m["type"] == "http.response.body" for m in messages[1:])
    out = {k.decode().lower(): v.decode() for k, v in start["headers"]}
    return start["status"], out, json.loads(b"".join(m.get("body", b"") for m in messages[1:]))


@pytest.fixture(scope="module")
def replica(tiny_model):
    settings = Settings.load({"device": "cpu"}, config_file=Path("/nonexistent"))
    engine = rayserve().EngineReplica(settings, [str(tiny_model)])
    yield engine
    engine.close()


def test_an_engine_replica_answers_errors_and_heads_like_the_daemon(daemon, replica):
    for path in ("/v1/systemone", "/v1/basal"):
        for body in bodies(3):
            raw = json.dumps(body).encode()
            status, headers, out = run_exchange(replica, path, raw, {"x-request-id": "rid-1"})
            want_status, want_headers, want = http("POST", daemon.url + path, body, headers={"x-request-id": "rid-1"})
            assert status == want_status == 200, out
            assert np.abs(probabilities(out["answers"]) - probabilities(want["answers"])).max() <= 1e-6
            assert headers["x-request-id"] == headers["x-typesafe-request-id"] == "rid-1"
            assert headers[rayserve().REPLICA_HEADER.decode()].startswith("local-")
            same = {k.lower() for k in want_headers} - {"date", "server", "content-length", "connection"}
            assert same - set(headers) == set(), same - set(headers)  # every header the daemon sends
    # the unary call (what the front uses for a decision) hands back the same messages as one list
    raw = json.dumps(bodies(1)[0]).encode()
    whole = asyncio.run(replica.exchange_whole(scope("/v1/basal", raw, {"x-request-id": "rid-2"}), raw))
    assert [m["type"] for m in whole] == ["http.response.start", "http.response.body"] and whole[0]["status"] == 200
    assert json.loads(whole[1]["body"])["answers"] == run_exchange(replica, "/v1/basal", raw)[2]["answers"]
    # errors come from the daemon's own handlers and guards, in each dialect's shape
    for path, raw, extra in [("/v1/systemone", b"{not json", {}), ("/v1/basal", b'{"state": 3}', {}),
                             ("/v1/systemone", b"{}", {"origin": "https://evil.example"}),
                             ("/v1/nothing", b"{}", {})]:
        status, _, out = run_exchange(replica, path, raw, extra)
        want_status, _, want = http("POST", daemon.url + path, raw,
                                    headers={"content-type": "application/json", **extra})
        assert (status, out) == (want_status, want)
        assert status in (400, 403, 404, 422)


class _Died(Exception):
    pass


class _FakeHandle:
    """A stand-in for the engine deployment's handle: `exchange_whole.remote` (unary, what a decision takes) and,
    through `options(stream=True)`, `exchange.remote` (a stream, what the event stream takes). The first `deaths`
    calls die before answering."""

    def __init__(self, deaths: int, died: type[BaseException]) -> None:
        self.deaths, self.died, self.calls = deaths, died, 0
        self.unary = self.streamed = 0
        self.exchange = _Method(self, streamed=True)
        self.exchange_whole = _Method(self, streamed=False)

    def options(self, **_):
        return self

    def answer(self, body: bytes) -> list[dict]:
        self.calls += 1
        if self.calls <= self.deaths:
            raise self.died()
        return [{"type": "http.response.start", "status": 200,
                 "headers": [(b"x-request-id", b"r"), (b"content-type", b"application/json")]},
                {"type": "http.response.body", "body": json.dumps({"ok": self.calls, "len": len(body)}).encode(),
                 "more_body": False}]


class _Method:
    def __init__(self, handle: _FakeHandle, streamed: bool) -> None:
        self.handle, self.streamed = handle, streamed

    def remote(self, scope, body, complete):
        handle = self.handle
        if not self.streamed:
            handle.unary += 1

            async def whole():
                return handle.answer(body)

            return whole()
        handle.streamed += 1

        async def gen():
            for message in handle.answer(body):
                yield message

        return gen()


def front_call(front: Front, path: str, chunks: list[bytes]):
    sent: list[dict] = []

    async def go():
        queue = [{"type": "http.request", "body": c, "more_body": i < len(chunks) - 1} for i, c in enumerate(chunks)]

        async def receive():
            return queue.pop(0) if queue else {"type": "http.disconnect"}

        async def send(message):
            sent.append(message)

        await front.asgi({"type": "http", "method": "POST", "path": path, "headers": []}, receive, send)

    asyncio.run(go())
    return sent


def test_the_front_retries_a_request_whose_replica_died():
    ray_exceptions = pytest.importorskip("ray.exceptions", reason="Ray is not installed (pip install '.[ray]')")
    died = ray_exceptions.ActorDiedError
    for path, unary in (("/v1/basal", True), ("/api/events", False)):  # one unary call, or the event stream
        engine = _FakeHandle(deaths=2, died=died)
        front = rayserve().Front(engine, max_body_bytes=1000, body_timeout_s=5)
        sent = front_call(front, path, [b'{"a":', b" 1}"])
        assert engine.calls == 3  # two replicas died, the third answered
        assert (engine.unary, engine.streamed) == ((3, 0) if unary else (0, 3))
        assert sent[0]["status"] == 200 and (b"x-request-id", b"r") not in sent[0]["headers"]  # Ray's proxy adds it
        assert json.loads(sent[1]["body"]) == {"ok": 3, "len": 8}
    # every try dies: a 503 in the path's dialect, never a traceback
    engine = _FakeHandle(deaths=99, died=died)
    sent = front_call(rayserve().Front(engine, 1000, 5), "/v1/systemone", [b"{}"])
    assert sent[0]["status"] == 503 and engine.calls == 4
    assert json.loads(sent[1]["body"])["detail"]["error_type"] == "unavailable_error"
    # any other failure is not retried (it would fail again)
    engine = _FakeHandle(deaths=1, died=ValueError)
    with pytest.raises(ValueError):
        front_call(rayserve().Front(engine, 1000, 5), "/v1/basal", [b"{}"])
    assert engine.calls == 1


def test_ray_flags_need_ray_and_the_ray_mode_refuses_one_host_flags(tiny_model):
    def cli(*args):
        return cli_run(["serve", "--model", str(tiny_model), *args],
                              capture_output=True, text=True, timeout=60)

    out = cli("--min-replicas", "2")
    assert out.returncode == 2 and "--min-replicas only works with --ray" in out.stderr
    assert "Traceback" not in out.stderr
    out = cli("--ray-fronts", "2")
    assert out.returncode == 2 and "--ray-fronts only works with --ray" in out.stderr
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
    status, headers, out = http("POST", url, body, timeout=120)
    return status, headers.get(rayserve().REPLICA_HEADER.decode()) or headers.get("X-Basal-Local-Replica"), out


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
        seen = set()
        for (path, i), (status, replica_id, out) in zip(jobs, got):
            assert status == 200, out
            assert np.abs(probabilities(out["answers"]) - probabilities(want[path][i])).max() <= 1e-6
            seen.add(replica_id)
        assert len(seen) == 2, seen  # both replicas answered
        # kill one engine replica's process while requests are in flight: every request is still answered
        victims = served.engine_pids()
        assert len(victims) == 2, victims
        with ThreadPoolExecutor(16) as pool:
            futures = [pool.submit(_post, served.url + path, work[i]) for path, i in jobs]
            time.sleep(0.3)
            os.kill(victims[0], signal.SIGKILL)
            results = [f.result() for f in futures]
        for (path, i), (status, _, out) in zip(jobs, results):
            assert status == 200, out
            assert np.abs(probabilities(out["answers"]) - probabilities(want[path][i])).max() <= 1e-6
        # Ray Serve replaces the dead replica: a replica not seen before answers within a minute or two
        deadline = time.monotonic() + 150
        fresh = set()
        while time.monotonic() < deadline and not fresh:
            with ThreadPoolExecutor(8) as pool:
                fresh = {r[1] for r in pool.map(lambda b: _post(served.url + "/v1/basal", b), work[:8])} - seen
            time.sleep(1)
        assert fresh, "the killed replica was not replaced"
        print(f"ray: ready after {ready_s:.1f} s, whole test {time.monotonic() - started:.1f} s")
    finally:
        log = served.stop()
    assert served.proc.returncode == 0, log[-3000:]
    assert "Traceback" not in log, log[-3000:]
    left = [pid for pid in served.tree if _alive(pid)]
    assert not left, f"Ray processes outlived the command: {left}"

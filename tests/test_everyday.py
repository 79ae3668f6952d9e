"""Everyday use of the daemon and its tools: stopping, the log file, keys, interruptions, `run`'s output.

Signals and exit codes are checked on real processes (the suite's forked CLI); nothing here needs a terminal.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest

from .conftest import Daemon, free_port
from .zygote import cli_popen


@pytest.fixture
def home(tmp_path) -> dict:
    (tmp_path / "hub").mkdir()
    return {"BASAL_LOCAL_HOME": str(tmp_path / "basal"), "HF_HUB_CACHE": str(tmp_path / "hub"),
            "HF_ENDPOINT": f"http://127.0.0.1:{free_port()}", "HF_HUB_DISABLE_TELEMETRY": "1",
            "XDG_CONFIG_HOME": str(tmp_path / "xdg"), "BASAL_LOCAL_API_KEY": ""}


def _open_events(port: int) -> socket.socket:
    """An /api/events reader that has read the stream's first comment."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    sock.sendall(f"GET /api/events HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n\r\n".encode())
    head = b""
    while b"basal-local events" not in head:
        chunk = sock.recv(4096)
        assert chunk, head
        head += chunk
    return sock


def _read_to_eof(sock: socket.socket) -> bytes:
    rest = b""
    while chunk := sock.recv(4096):
        rest += chunk
    return rest


def test_sigint_with_an_event_reader_attached_stops_at_once_and_cleanly(tiny_model, home):
    # a drain far longer than the wait below: the stop must not wait for the stream at all
    d = Daemon(["--model", str(tiny_model), "--device", "cpu", "--drain", "60"], env=home)
    try:
        d.wait_ready()
        readers = [_open_events(d.port), _open_events(d.port)]
        readers[1].close()  # one reader gone: its stream only notices on its next write
        d.proc.send_signal(signal.SIGINT)
        assert d.proc.wait(timeout=30) == 0
        rest = _read_to_eof(readers[0])
        assert rest.endswith(b"0\r\n\r\n"), rest[-200:]  # the chunked body ended, not a reset connection
        readers[0].close()
    finally:
        log = d.stop()
    assert "Traceback" not in log and "Cancel" not in log and "ASGI" not in log, log
    assert "basal-local: stopped" in log


def test_the_log_file_is_written_and_doctor_checks_it(tiny_model, home):
    d = Daemon(["--model", str(tiny_model), "--device", "cpu"], env=home)
    try:
        d.wait_ready()
    finally:
        log = d.stop()
    path = Path(home["BASAL_LOCAL_HOME"]) / "logs" / "basal-local.log"
    assert f"log: {path}" in log
    text = path.read_text(encoding="utf-8")
    assert "basal_local.daemon: loaded" in text, text  # our format, our records
    from .test_cli import cli

    done = cli("doctor", "--json", env=home)
    (check,) = [c for c in json.loads(done.stdout)["checks"] if c["name"] == "logs"]
    assert check["status"] == "ok", check
    assert path.stat().st_size > len(text.encode())  # doctor's own line went into the file
    path.unlink()
    path.mkdir()  # a log path that cannot be written (a folder in its place; even root cannot write it)
    done = cli("doctor", "--json", env=home)
    (check,) = [c for c in json.loads(done.stdout)["checks"] if c["name"] == "logs"]
    assert check["status"] == "warn" and "cannot be written" in check["detail"], check


# ---- a stand-in daemon for the tools' own behaviour (interruptions, 529s, a daemon that dies) ------------------

class FakeDaemon:
    """A threaded HTTP server with the daemon's routes that answers every decision `yes` after `delay_s`;
    the first `overload` decisions get 529 + retry-after-ms, and it closes itself after `die_after` of them."""

    def __init__(self, delay_s: float = 0.0, overload: int = 0, die_after: int = 0) -> None:
        import http.server
        import threading

        self.decisions = 0
        self.lock = threading.Lock()
        fake = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args) -> None:
                pass

            def _answer(self, status: int, body: dict, headers: dict | None = None) -> None:
                data = json.dumps(body).encode()
                self.send_response(status)
                for name, value in {"content-type": "application/json", "content-length": str(len(data)),
                                    **(headers or {})}.items():
                    self.send_header(name, value)
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self) -> None:
                self._answer(200, {"status": "ok", "default_model": "m", "models": [{"name": "m"}]})

            def do_POST(self) -> None:
                self.rfile.read(int(self.headers.get("content-length", 0)))
                with fake.lock:
                    fake.decisions += 1
                    n = fake.decisions
                if die_after and n >= die_after:  # gone: no answer, the connection dropped, the port closed
                    if n == die_after:
                        threading.Thread(target=fake.close, daemon=True).start()
                    self.close_connection = True
                    return None
                if n <= overload:
                    return self._answer(529, {"error": "overloaded"}, {"retry-after-ms": "50", "retry-after": "1"})
                time.sleep(delay_s)
                self._answer(200, {"model": "m", "answers": {"q": {"type": "noul", "noul": 0.75}},
                                   "usage": {"latency_ms": 1.0}})

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def _items(path: Path, n: int) -> None:
    path.write_text("".join(json.dumps({"state": f"m{i}", "question": "urgent?", "gold": True}) + "\n"
                            for i in range(n)))


def _wait_for(predicate, timeout: float = 60.0) -> None:
    deadline = time.time() + timeout
    while not predicate():
        assert time.time() < deadline, "timed out waiting"
        time.sleep(0.05)


def test_run_ctrl_c_keeps_the_answers_and_resume_completes_in_order(tmp_path, home):
    fake = FakeDaemon(delay_s=0.02)
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    _items(src, 400)
    try:
        proc = cli_popen(["run", "--url", fake.url, "--input", src, "--output", out, "--concurrency", "2"],
                         env={**os.environ, **home}, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        _wait_for(lambda: out.exists() and out.read_text().count("\n") >= 20)
        proc.send_signal(signal.SIGINT)
        stdout, stderr = proc.communicate(timeout=30)
        assert proc.returncode == 130, stderr
        assert "Traceback" not in stderr and "interrupted" in stderr and "--resume" in stderr, stderr
        kept = [json.loads(line) for line in out.read_text().splitlines()]
        assert 20 <= len(kept) < 400 and all(r["status"] == 200 for r in kept)
        asked = fake.decisions
        from .test_cli import cli

        done = cli("run", "--url", fake.url, "--input", str(src), "--output", str(out), "--resume", env=home)
        assert done.returncode == 0, done.stderr
        assert fake.decisions - asked == 400 - len(kept)  # only the missing ones were asked again
        rows = [json.loads(line) for line in out.read_text().splitlines()]
        assert [r["index"] for r in rows] == list(range(400))
        assert rows[kept[0]["index"]] == kept[0]  # an earlier answer is kept as it was
        assert f"({len(kept)} answered before, resumed)" in done.stdout
    finally:
        fake.close()


def test_run_refuses_its_input_as_output_and_counts_failures_by_reason(live, home, tmp_path):
    from .test_cli import assert_user_error, cli

    home = {**home, "BASAL_LOCAL_API_KEY": "sekret"}

    src = tmp_path / "in.jsonl"
    _items(src, 2)
    before = src.read_text()
    assert_user_error(cli("run", "--url", live.url, "--input", str(src), "--output", str(tmp_path / "." / "in.jsonl"),
                          env=home), "is the input file")
    assert src.read_text() == before
    bogus = {"state": "x", "questions": {"q": {"type": "bogus", "instructions": "?"}}}
    items = [{"state": "x", "question": "ok?"}] + [bogus] * 3
    items.append({"model": "nope", "state": "x", "questions": {"q": {"type": "noul", "instructions": "ok?"}}})
    src.write_text("".join(json.dumps(i) + "\n" for i in items))
    out = tmp_path / "out.jsonl"
    done = cli("run", "--url", live.url, "--input", str(src), "--output", str(out), env=home)
    assert done.returncode == 1
    assert "4 failed" in done.stdout
    reasons = [line.strip() for line in done.stdout.splitlines() if " failed: " in line]
    assert any(line.strip().startswith("3 failed: HTTP 4") for line in reasons), done.stdout
    assert any(line.strip().startswith("1 failed: HTTP 4") and "nope" in line for line in reasons), done.stdout
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["status"] == 200 for r in rows] == [True, False, False, False, False]
    assert all(r["reason"].startswith("HTTP 4") for r in rows[1:])


@pytest.fixture(scope="module")
def live(tiny_model, tmp_path_factory):
    root = tmp_path_factory.mktemp("live")
    d = Daemon(["--model", str(tiny_model), "--device", "cpu", "--api-key", "sekret"],
               env={"BASAL_LOCAL_HOME": str(root)})
    _wait_for(lambda: b"ready:" in d.log.encode(), timeout=300)
    yield d
    d.stop()


def test_our_tools_send_the_api_key_and_say_what_a_401_means(live, home, tmp_path):
    from .test_cli import assert_user_error, cli

    ask = ["ask", "--url", live.url, "--state", "x", "--noul", "ok?"]
    assert_user_error(cli(*ask, env=home), "requires an API key", "--api-key")
    assert_user_error(cli(*ask, "--api-key", "wrong", env=home), "refused the API key", "BASAL_LOCAL_API_KEY")
    assert cli(*ask, "--api-key", "sekret", env=home).returncode == 0
    assert cli(*ask, env={**home, "BASAL_LOCAL_API_KEY": "sekret"}).returncode == 0
    assert_user_error(cli("ps", "--url", live.url, env=home), "requires an API key")
    done = cli("ps", "--url", live.url, "--json", "--api-key", "sekret", env=home)
    assert json.loads(done.stdout)["ready"], done.stderr
    src = tmp_path / "in.jsonl"
    _items(src, 3)
    assert_user_error(cli("run", "--url", live.url, "--input", str(src), "--output", str(tmp_path / "o.jsonl"),
                          env=home), "requires an API key")
    done = cli("run", "--url", live.url, "--input", str(src), "--output", str(tmp_path / "o.jsonl"),
               "--api-key", "sekret", env=home)
    assert done.returncode == 0, done.stderr
    assert_user_error(cli("bench", "--http", live.url, "--requests", "2", env=home), "requires an API key")
    done = cli("bench", "--http", live.url, "--requests", "4", "--json", "--api-key", "sekret", env=home)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["requests"] == 4
    import asyncio

    from basal_local.tui.client import DaemonClient, _reason

    async def stats(key):
        client = DaemonClient(live.url, api_key=key)
        try:
            return await client.stats()
        finally:
            await client.aclose()

    assert asyncio.run(stats("sekret"))["ready"]
    import httpx

    with pytest.raises(httpx.HTTPStatusError) as caught:
        asyncio.run(stats(None))
    assert "API key" in _reason(caught.value)


def test_ask_says_what_to_do_for_each_refusal(live, home, tmp_path):
    from .test_cli import assert_user_error, cli

    home = {**home, "BASAL_LOCAL_API_KEY": "sekret"}
    base = ["ask", "--state", "x", "--noul", "ok?"]
    done = cli(*base, "--url", live.url, "--model", "nope", env=home)
    assert_user_error(done, "Unknown model", "--model", "basal-local ps")
    assert_user_error(cli(*base, "--url", live.url + "/v1/basal", env=home), "has a path", live.url)
    done = cli("ask", "--url", live.url, "--state", "@-", "--noul", "ok?", "--json", env=home, stdin="from stdin")
    assert done.returncode == 0 and json.loads(done.stdout)["answers"]["q"]["type"] == "noul"
    options = [f"-o=k{i}=option {i}" for i in range(12)]
    done = cli("ask", "--url", live.url, "--state", "x", "--choice", "which?", *options, env=home)
    assert done.returncode == 0, done.stderr
    assert "/v1/systemone" in done.stdout and "k11" in done.stdout


def test_bench_http_honours_retry_after_and_stops_at_once_on_ctrl_c(home):
    fake = FakeDaemon(overload=3)
    try:
        from .test_cli import cli

        done = cli("bench", "--http", fake.url, "--requests", "6", "--json", env=home)
        result = json.loads(done.stdout)
        assert done.returncode == 0 and result["requests"] == 6 and result["errors"] == 0, done
        assert result["retried_529"] == 3 and fake.decisions == 9
    finally:
        fake.close()
    fake = FakeDaemon(delay_s=0.02)
    try:
        proc = cli_popen(["bench", "--http", fake.url, "--requests", "100000", "--clients", "2"],
                         env={**os.environ, **home}, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        _wait_for(lambda: fake.decisions >= 10)
        proc.send_signal(signal.SIGINT)
        _, stderr = proc.communicate(timeout=30)
        assert proc.returncode == 130 and "interrupted" in stderr and "Traceback" not in stderr, stderr
        sent = fake.decisions
        time.sleep(0.5)  # two clients would have sent ~50 more by now
        assert fake.decisions <= sent + 2
    finally:
        fake.close()


def test_bench_http_ends_non_zero_when_the_daemon_dies(home):
    fake = FakeDaemon(die_after=5)
    from .test_cli import cli

    done = cli("bench", "--http", fake.url, "--requests", "5000", "--json", env=home)
    assert done.returncode == 1
    assert "went away" in done.stderr and "Traceback" not in done.stderr, done.stderr
    result = json.loads(done.stdout)
    assert result["daemon_gone"] and result["requests"] < 5000


# ---- start-up: -v anywhere, --port 0, failures without the demo's "try it", devices as one sentence ------------

def test_verbose_after_the_subcommand(home):
    from .test_cli import cli

    done = cli("doctor", "--json", "-v", env=home)
    assert "checks" in json.loads(done.stdout), done.stderr
    assert cli("list", "-v", env=home).returncode == 0


def test_port_zero_listens_on_a_free_port_and_says_which(tiny_model, home):
    import re

    proc = cli_popen(["serve", "--model", tiny_model, "--device", "cpu", "--port", "0"],
                     env={**os.environ, **home}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        first = proc.stdout.readline() + proc.stdout.readline()
        found = re.search(r"serving on http://127\.0\.0\.1:(\d+) ", first)
        assert found, first
        port = int(found.group(1))
        assert port != 0
        from .conftest import http

        def ready() -> bool:
            try:
                return http("GET", f"http://127.0.0.1:{port}/health", timeout=2)[0] == 200
            except OSError:
                return False

        _wait_for(ready, timeout=240)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=60)
    assert proc.returncode == 0


def test_a_failed_start_shows_no_try_it_text(tiny_model, home, tmp_path):
    import shutil

    from .test_cli import subcli

    twin = tmp_path / "twin"
    shutil.copytree(tiny_model, twin)
    meta = json.loads((twin / "basal.json").read_text())
    (twin / "basal.json").write_text(json.dumps({**meta, "name": "basal-demo"}))  # the demo's name: load fails
    done = subcli("serve", "--demo", "--model", str(twin), "--port", str(free_port()), "--device", "cpu", env=home)
    out = done.stdout + done.stderr
    assert done.returncode == 1 and "two models are named" in out, out
    assert "Try it" not in out and "curl" not in out, out


@pytest.mark.parametrize("spec, words", [("banana", ["'banana' is not a device", "cuda:N"]),
                                         ("cuda:0,cuda:1", ["--devices cuda:0,cuda:1"])])
def test_devices_mistakes_are_one_sentence(home, spec, words):
    import torch

    from .test_cli import assert_user_error, cli

    if spec.startswith("cuda") and torch.cuda.device_count() >= 2:
        pytest.skip("two GPUs here: the spec is valid (the case checks the refusal without them)")
    assert_user_error(cli("serve", "--demo", "--devices", spec, env=home), *words)


# ---- user mistakes that were "internal error ... please report it" ----------------------------------------------

def test_make_test_model_into_a_folder_it_cannot_create(home, tmp_path):
    from .test_cli import assert_user_error, cli

    (tmp_path / "file").write_text("x")
    assert_user_error(cli("make-test-model", str(tmp_path / "file" / "model"), env=home),
                      "cannot write the test model", "a folder you can write to")


def test_bench_checks_its_extras_before_running(home, monkeypatch):
    import importlib.util

    import basal_local.backends.select as select

    from .test_cli import assert_user_error, cli

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "transformers" else real(name, *a))
    done = cli("bench", "--baseline", "transformers", env=home)
    assert_user_error(done, "needs Hugging Face transformers", "drop --baseline")
    assert "single decisions" not in done.stderr  # refused before the bench ran
    monkeypatch.setattr(select, "mlx_importable", lambda: False)
    assert_user_error(cli("bench", "--backend", "mlx", env=home), "MLX is not installed", "--backend torch")


def test_service_install_refuses_a_model_that_is_not_there(home, tmp_path):
    from .test_cli import assert_user_error, cli

    assert_user_error(cli("service", "install", "--model", "mini", "--print", env=home), "mini")
    assert_user_error(cli("service", "install", "--model", str(tmp_path / "nothing"), "--print", env=home))


def test_service_unit_does_not_restart_on_a_user_mistake(home, tmp_path):
    from basal_local.commands.service import render

    from .test_cli import subcli

    assert "RestartPreventExitStatus=2" in render("systemd", ["basal-local", "serve"], tmp_path / "log")
    # what the unit runs exits 2 when its model has gone: systemd then leaves it stopped
    done = subcli("serve", "--model", str(tmp_path / "gone"), "--port", str(free_port()), env=home)
    assert done.returncode == 2


def test_bench_progress_says_how_far_and_how_long_is_left(capsys):
    from basal_local.bench import Ticker

    now = [0.0]
    ticker = Ticker("single decisions", 10, every_s=5.0, clock=lambda: now[0])
    lines = []
    for _ in range(10):
        lines.append(ticker.step())
        now[0] += 2.0  # each item takes 2 s
    shown = [line for line in lines if line]
    # after 3 items (6 s): 7 left at 2 s each; the next line 5 s later at least
    assert shown[0] == "single decisions 3/10, about 14 s left"
    assert shown[1] == "single decisions 6/10, about 8 s left"
    assert "single decisions 3/10" in capsys.readouterr().err


# ---- the daemon in the background ----------------------------------------------------------------------------

def test_detach_status_logs_stop(tiny_model, home):
    from .test_cli import subcli

    done = subcli("serve", "--detach", "--model", str(tiny_model), "--device", "cpu", "--port", "0", env=home)
    state = Path(home["BASAL_LOCAL_HOME"]) / "state" / "daemon.json"
    try:
        assert done.returncode == 0, done.stdout + done.stderr
        assert "ready on http://127.0.0.1:" in done.stdout
        info = json.loads(state.read_text())
        status = subcli("status", env=home)
        assert status.returncode == 0 and f"pid {info['pid']}" in status.stdout and "ready" in status.stdout
        logs = subcli("logs", env=home)
        assert "basal-local: ready:" in logs.stdout
        assert logs.stdout.count("basal_local.daemon: loaded") == 1  # stdout and the log handler: one copy
        again = subcli("serve", "--detach", "--model", str(tiny_model), "--device", "cpu", env=home)
        assert again.returncode == 2 and "already running" in again.stderr
    finally:
        stopped = subcli("stop", env=home)
    assert stopped.returncode == 0, stopped.stderr
    assert not state.exists()
    assert subcli("status", env=home).returncode == 3
    assert subcli("stop", env=home).returncode == 1

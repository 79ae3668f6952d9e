"""Our tools against a daemon: `run` (Ctrl-C, resume, failures), `bench --http` (529, Ctrl-C, a daemon that dies),
the API key of ask/run/ps/top/bench, and `ask`'s refusals. Signals are sent to real (forked) processes.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from .conftest import Daemon, cli_popen

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
    assert_user_error(cli("run", "--url", live.url, "--input", str(src), "--output", str(tmp_path), env=home),
                      "is a folder", "answers.jsonl")
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
    assert "/v1/systemone" in done.stdout and "k11" in done.stdout and "TypeSafe confidence" in done.stdout


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


def test_the_run_summary_reads_well_when_nothing_was_answered(tmp_path, capsys):
    """All items failed, or a resume with nothing left: no "median latency nan ms", "0.0 s", "1 items"."""
    from basal_local.commands.batch import summary

    rows = {0: {"index": 0, "status": 529, "latency_ms": 3.0, "reason": "overloaded (529)"}}
    assert summary([{}], rows, [0], 0.012, tmp_path / "out.jsonl") == 1
    line = capsys.readouterr().out.splitlines()[0]
    assert line == "basal-local: 1 item in 12 ms (83.3 items/s), 1 failed", line
    done = {0: {"index": 0, "status": 200, "latency_ms": 3.0, "answers": {}}}
    assert summary([{}], done, [], 0.0, tmp_path / "out.jsonl") == 0
    line = capsys.readouterr().out.splitlines()[0]
    assert line == "basal-local: 0 items in 0 ms, 0 failed (1 answered before, resumed)", line


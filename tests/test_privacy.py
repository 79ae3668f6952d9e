"""What a local observer may see (SECURITY.md), over a real daemon process: no state text in error records, stats
or events; questions, answers and logged bodies only with the dashboard token; request ids that cannot be reused."""

from __future__ import annotations

import json
import os
import socket
import stat
import time

import pytest

from basal_local.telemetry.privacy import TOKEN_HEADER, read_token, token_path

from . import rawhttp
from .conftest import Daemon

M = "basal-test-tiny"
SECRET = "SECRET-STATE-b91c"
QUESTIONS = {"q": {"type": "choice", "instructions": "Which one?", "criteria": {"a": "first", "b": "second"}}}


@pytest.fixture(scope="module")
def home(tmp_path_factory):
    return tmp_path_factory.mktemp("home")


@pytest.fixture(scope="module")
def d(tiny_model, home):
    daemon = Daemon(["--model", str(tiny_model), "--device", "cpu", "--log-bodies"], {"BASAL_LOCAL_HOME": str(home)})
    daemon.wait_ready()
    yield daemon
    daemon.stop()


@pytest.fixture
def token(d, home, monkeypatch):
    monkeypatch.setenv("BASAL_LOCAL_HOME", str(home))
    value = read_token(d.url)
    assert value, "the daemon wrote no dashboard token"
    return value


def events_text(port: int, headers: dict[str, str], seconds: float = 1.0) -> str:
    """What an `/api/events` subscriber from the beginning of the history receives in `seconds`."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=seconds)
    extra = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
    sock.sendall(f"GET /api/events?since=0 HTTP/1.1\r\nHost: 127.0.0.1\r\n{extra}\r\n".encode())
    data, end = b"", time.monotonic() + seconds
    try:
        while time.monotonic() < end:
            chunk = sock.recv(65536)
            if not chunk:
                break
            data += chunk
    except OSError:  # the timeout ends the read
        pass
    finally:
        sock.close()
    return data.decode("utf-8", "replace")


def test_the_token_file_is_private_and_removed_at_exit(tiny_model, tmp_path, monkeypatch):
    monkeypatch.setenv("BASAL_LOCAL_HOME", str(tmp_path))
    daemon = Daemon(["--model", str(tiny_model), "--device", "cpu"], {"BASAL_LOCAL_HOME": str(tmp_path)})
    try:
        daemon.wait_ready()
        path = token_path(daemon.port)
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600 and len(read_token(daemon.url)) >= 32
    finally:
        daemon.stop()
    assert not path.exists()


@pytest.mark.parametrize("path", ["/v1/systemone", "/v1/basal"])
def test_a_422_that_echoes_the_state_keeps_it_out_of_records_stats_and_events(d, token, path):
    rid = f"bad-{path[4:]}"
    body = {"model": M, "state": SECRET, "questions": {"q": {"type": "choice", "instructions": SECRET,
                                                           "options": SECRET}}}
    status, _, answer = rawhttp.post(d.port, path, body, {"x-request-id": rid})
    assert status == 422
    assert SECRET in json.dumps(answer) or path == "/v1/basal"  # the caller's own answer may quote its input
    for headers in ({}, {TOKEN_HEADER: token}):
        record = rawhttp.get(d.port, f"/api/requests/{rid}", headers)[2]
        assert record["status"] == 422 and record["error"] and SECRET not in json.dumps(record), record
    assert SECRET not in json.dumps(rawhttp.get(d.port, "/api/stats")[2])
    # --log-bodies logs the body: only the token's stream gets that log line
    assert SECRET not in events_text(d.port, {})
    assert SECRET in events_text(d.port, {TOKEN_HEADER: token})


def test_questions_and_answers_only_with_the_dashboard_token(d, token):
    assert rawhttp.post(d.port, "/v1/systemone", {"model": M, "state": "x", "questions": QUESTIONS},
                        {"x-request-id": "mine"})[0] == 200
    public = rawhttp.get(d.port, "/api/requests/mine")[2]
    assert "asked" not in public and "answers" not in public and "SECURITY.md" in public["withheld"]
    assert public["status"] == 200 and public["questions"] == 1  # counts and timings stay public
    for wrong in ("", "x" * 32, token[:-1]):
        assert "asked" not in rawhttp.get(d.port, "/api/requests/mine", {TOKEN_HEADER: wrong})[2]
    full = rawhttp.get(d.port, "/api/requests/mine", {TOKEN_HEADER: token})[2]
    assert full["asked"][0]["instructions"] == "Which one?" and set(full["answers"]) == {"q"}


def test_a_request_id_in_use_is_not_reused(d, token):
    assert rawhttp.post(d.port, "/v1/systemone", {"model": M, "state": "x", "questions": QUESTIONS},
                        {"x-request-id": "victim"})[0] == 200
    status, headers, _ = rawhttp.post(d.port, "/v1/systemone", {"model": M, "state": "y", "questions": {}},
                                      {"x-request-id": "victim"})
    assert status == 422 and headers["x-request-id"] == "victim"  # the client's own id is still echoed
    record = rawhttp.get(d.port, "/api/requests/victim", {TOKEN_HEADER: token})[2]
    assert record["status"] == 200 and set(record["answers"]) == {"q"}  # the first request's record is intact
    ids = [r["id"] for r in rawhttp.get(d.port, "/api/stats")[2]["requests"]]
    assert ids.count("victim") == 1 and len(ids) == len(set(ids))  # the second one has a record of its own
    long_id = "z" * 500
    assert rawhttp.post(d.port, "/v1/basal", {"model": M, "state": "x", "questions": QUESTIONS},
                        {"x-request-id": long_id})[0] == 200
    assert rawhttp.get(d.port, f"/api/requests/{long_id}")[0] == 404  # not recorded under a 500-character id

"""When `--drain` runs out, the requests still in flight get the dialect's 503 + Retry-After, not uvicorn's
plain-text 500, and the log has one line each (no traceback). Over a real daemon process and raw sockets."""

from __future__ import annotations

import json
import os
import signal
import time

import pytest

from . import rawhttp
from .conftest import Daemon
from .test_reliability import d  # noqa: F401  (the session daemon)


def _cut(model, path: str, drain: str, signals: int, headers: dict[str, str]) -> tuple[tuple, str]:
    """A request whose body never completes, still in flight when the daemon gets `signals` SIGTERMs (0.5 s
    apart): its answer (status, headers, body) and the daemon's output."""
    daemon = Daemon(["--model", str(model), "--device", "cpu", "--drain", drain, "--body-timeout", "60"])
    try:
        daemon.wait_ready()
        sock = rawhttp.connect(daemon.port)
        sock.sendall(rawhttp.request_bytes("POST", path, b'{"model": "', content_length=300, headers=headers))
        time.sleep(0.3)
        for i in range(signals):
            time.sleep(0.5 if i else 0.0)  # the second while the first one's drain runs
            os.kill(daemon.proc.pid, signal.SIGTERM)
        answer = rawhttp.read_response(sock, deadline_s=15)
        sock.close()
        assert daemon.proc.wait(timeout=15) == 0
    finally:
        output = daemon.stop()
    return answer, output


@pytest.mark.parametrize("path", ["/v1/systemone", "/v1/basal"])
def test_requests_cut_by_the_drain_get_a_503_in_the_dialect_shape(tiny_model, path):
    # the body never completes: the request is still in flight when the 1 s drain runs out
    (status, headers, body), output = _cut(tiny_model, path, "1", 1, {"x-request-id": "cut-by-drain"})
    assert status == 503, (status, body, output)
    assert headers["retry-after"] == "5" and headers["x-request-id"] == "cut-by-drain"
    answer = json.loads(body)
    if path == "/v1/basal":
        assert set(answer) == {"error"} and "shutting down" in answer["error"]
    else:
        assert set(answer) == {"detail"} and set(answer["detail"]) == {"error_type", "message"}
    assert "Traceback" not in output and "Exception in ASGI application" not in output, output
    assert sum("ran out, answered 503" in line for line in output.splitlines()) == 1, output


def test_a_second_signal_cuts_the_drain_and_the_log_says_so(tiny_model):
    (status, _, _), output = _cut(tiny_model, "/v1/basal", "60", 2, {})  # the request would have 60 s
    assert status == 503, output
    cut = [line for line in output.splitlines() if "answered 503" in line]
    assert len(cut) == 1 and "a second signal stopped the daemon at once" in cut[0], output


@pytest.mark.parametrize("raw", [b"GARBAGE\r\n\r\n", b"GET / HTTP/1.1\r\nBad Header\r\n\r\n",
                                 b"POST /v1/basal HTTP/1.1\r\nHost: x\r\nContent-Length: abc\r\n\r\n{}"])
def test_malformed_http_gets_a_json_400(d, raw):  # noqa: F811
    sock = rawhttp.connect(d.port)
    try:
        sock.sendall(raw)
        status, headers, body = rawhttp.read_response(sock, deadline_s=10)
    finally:
        sock.close()
    assert status == 400 and headers["content-type"] == "application/json", (headers, body)
    answer = json.loads(body)
    assert answer["code"] == "BAD_REQUEST" and answer["error"].startswith("malformed HTTP request")

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


@pytest.mark.parametrize("path", ["/v1/systemone", "/v1/basal"])
def test_requests_cut_by_the_drain_get_a_503_in_the_dialect_shape(tiny_model, path):
    daemon = Daemon(["--model", str(tiny_model), "--device", "cpu", "--drain", "1", "--body-timeout", "60"])
    try:
        daemon.wait_ready()
        sock = rawhttp.connect(daemon.port)
        # a body that never completes keeps the request in flight past the 1 s drain
        sock.sendall(rawhttp.request_bytes("POST", path, b'{"model": "', content_length=300,
                                           headers={"x-request-id": "cut-by-drain"}))
        time.sleep(0.3)
        os.kill(daemon.proc.pid, signal.SIGTERM)
        status, headers, body = rawhttp.read_response(sock, deadline_s=15)
        sock.close()
        assert daemon.proc.wait(timeout=15) == 0
    finally:
        output = daemon.stop()
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
    daemon = Daemon(["--model", str(tiny_model), "--device", "cpu", "--drain", "60", "--body-timeout", "60"])
    try:
        daemon.wait_ready()
        sock = rawhttp.connect(daemon.port)
        sock.sendall(rawhttp.request_bytes("POST", "/v1/basal", b'{"model": "', content_length=300))
        time.sleep(0.3)
        os.kill(daemon.proc.pid, signal.SIGTERM)
        time.sleep(0.5)  # draining: the request would have 60 s
        os.kill(daemon.proc.pid, signal.SIGTERM)
        status, _, _ = rawhttp.read_response(sock, deadline_s=15)
        sock.close()
        assert daemon.proc.wait(timeout=15) == 0
    finally:
        output = daemon.stop()
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

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

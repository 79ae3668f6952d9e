"""The test harness itself: a daemon that writes a lot must not hang the run (tests/conftest.py `Daemon`)."""

from __future__ import annotations

import sys

from .conftest import Daemon, http

CHATTY = r'''
import sys
from http.server import BaseHTTPRequestHandler, HTTPServer

for i in range(20000):  # about 2 MB, far more than a pipe holds
    print(f"log line {i:06d} " + "x" * 80)
sys.stdout.flush()


class Health(BaseHTTPRequestHandler):
    def do_GET(self):
        body = b'{"status": "ok"}'
        self.send_response(200)
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        print("served", self.path, flush=True)


HTTPServer(("127.0.0.1", int(sys.argv[sys.argv.index("--port") + 1])), Health).serve_forever()
'''


def test_a_chatty_daemon_is_drained_and_its_log_kept(tmp_path):
    script = tmp_path / "chatty.py"
    script.write_text(CHATTY)
    d = Daemon([], command=[sys.executable, str(script)])
    try:
        d.wait_ready(timeout=20)  # an undrained pipe blocks the script before it ever listens
        assert http("GET", d.url + "/health")[0] == 200
    finally:
        log = d.stop()
    lines = log.splitlines()
    assert len(lines) == Daemon.LOG_LINES  # bounded: the oldest lines were dropped
    assert "log line 019999 " + "x" * 80 in lines and "served /health" in lines
    assert not any(line.startswith("log line 000000") for line in lines)


def test_every_planted_bug_still_fits_the_code():
    """tools/mutate.py reports a mutation whose snippet is gone as STALE only when someone runs it (minutes per
    mutation); here every snippet must occur exactly once in its file and every named test must exist."""
    from pathlib import Path

    from .mutations import MUTATIONS

    root = Path(__file__).resolve().parent.parent
    assert len({x.name for x in MUTATIONS}) == len(MUTATIONS)
    for x in MUTATIONS:
        text = (root / x.file).read_text(encoding="utf-8")
        for original, _ in x.edits:
            assert text.count(original) == 1, f"{x.name}: the snippet occurs {text.count(original)} times in {x.file}"
        for test in x.tests:
            path, _, name = test.partition("::")
            assert (root / path).is_file(), f"{x.name}: no {path}"
            assert not name or f"def {name}(" in (root / path).read_text(encoding="utf-8"), f"{x.name}: no {test}"

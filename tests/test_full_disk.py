"""A full disk under the daemon's output: it starts, serves and stops as usual, and says so once per output.

`/dev/full` answers every write with ENOSPC, as a full disk does: standard output goes there, and the log file
(`BASAL_LOCAL_HOME/logs/basal-local.log`) is a link to it. Before, the banner's `print` ended start-up with
"internal error: OSError: [Errno 28] No space left on device".
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from .conftest import cli_popen, free_port, http

FULL = Path("/dev/full")
pytestmark = pytest.mark.skipif(not FULL.exists(), reason="no /dev/full (Linux) on this machine")
M = "basal-test-tiny"


def test_a_full_disk_under_stdout_and_the_log_file_is_one_warning_each(tiny_model, tmp_path):
    home = tmp_path / "home"
    (home / "logs").mkdir(parents=True)
    (home / "logs" / "basal-local.log").symlink_to(FULL)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    errors = tmp_path / "stderr.txt"
    with open(FULL, "w") as full, open(errors, "w") as err:
        proc = cli_popen(["serve", "--port", str(port), "--model", str(tiny_model), "--device", "cpu"],
                         stdout=full, stderr=err, env={**os.environ, "BASAL_LOCAL_HOME": str(home)})
    try:
        deadline = time.time() + 240
        ready = False
        while time.time() < deadline and proc.poll() is None and not ready:
            try:
                ready = http("GET", url + "/health", timeout=2)[0] == 200
            except OSError:
                time.sleep(0.2)
        assert ready, errors.read_text()[-3000:]
        body = {"model": M, "state": "The parcel arrived broken.",
                "questions": {"q": {"type": "noul", "instructions": "Damaged?"}}}
        for path in ("/v1/systemone", "/v1/basal", "/v1/systemone"):
            status, _, out = http("POST", url + path, body)
            assert status == 200, out
        # a request that logs (a 4xx is an INFO/WARNING line on some paths): more records for the full log file
        assert http("POST", url + "/v1/basal", b"{not json", {"content-type": "application/json"})[0] == 422
    finally:
        proc.terminate()
        code = proc.wait(timeout=60)
    text = errors.read_text()
    assert code == 0, text[-3000:]
    assert text.count("standard output cannot be written (No space left on device); the daemon keeps "
                      "serving") == 1, text
    assert text.count(f"the log output {home / 'logs' / 'basal-local.log'} cannot be written (No space left on "
                      "device)") == 1, text
    for bad in ("Traceback", "Logging error", "internal error"):
        assert bad not in text, text

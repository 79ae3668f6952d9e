"""What a running batch costs interactive requests, and how fast a batch runs alone: one command, side by side.

    python tools/batch_latency.py [--model DIR | --demo] [--device cpu] [--clients 8] [--seconds 30] [--lines 50000]

Starts one daemon (`BASAL_LOCAL_HOME` in a temporary folder), then:
1. `--clients` interactive clients (sample requests on /v1/systemone, keep-alive) for `--seconds`: p50/p99;
2. the same while a batch of `--lines` lines runs (submitted just before): p50/p99, and the batch's progress;
3. the batch alone (a batch of `--alone-lines` after the rest is cancelled) in lines/s, beside
   `basal-local run` on the same lines (concurrency 32).
Prints one JSON object; every loop is bounded in count and time and talks to 127.0.0.1 only.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from netkit import Daemon, sample_requests  # noqa: E402


def _conn(port: int) -> http.client.HTTPConnection:
    return http.client.HTTPConnection("127.0.0.1", port, timeout=120)


def _call(conn: http.client.HTTPConnection, method: str, path: str, body: bytes | None = None,
          ctype: str = "application/json") -> tuple[int, bytes]:
    conn.request(method, path, body=body, headers={"content-type": ctype} if body is not None else {})
    resp = conn.getresponse()
    return resp.status, resp.read()


def interactive(port: int, model: str, clients: int, seconds: float) -> dict:
    samples = sample_requests()
    latencies: list[float] = []
    errors = [0]
    stop = time.time() + seconds

    def client(k: int) -> None:
        conn = _conn(port)
        i = k
        while time.time() < stop:
            body = json.dumps({**samples[i % len(samples)], "model": model}).encode()
            i += clients
            started = time.perf_counter()
            try:
                status, _ = _call(conn, "POST", "/v1/systemone", body)
            except OSError:
                conn = _conn(port)
                status = 0
            if status == 200:
                latencies.append((time.perf_counter() - started) * 1000)
            else:
                errors[0] += 1

    threads = [threading.Thread(target=client, args=(k,)) for k in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    latencies.sort()
    return {"requests": len(latencies), "errors": errors[0], "req_per_s": round(len(latencies) / seconds, 1),
            "p50_ms": round(statistics.median(latencies), 1) if latencies else None,
            "p99_ms": round(latencies[int(0.99 * (len(latencies) - 1))], 1) if latencies else None}


def batch_lines(count: int) -> bytes:
    samples = sample_requests()
    out = []
    for i in range(count):
        s = samples[i % len(samples)]
        out.append(json.dumps({"custom_id": f"b-{i}", "body": {"state": f"{s['state']} ({i})",
                                                               "questions": s["questions"]}}, ensure_ascii=False))
    return ("\n".join(out) + "\n").encode()


def submit(port: int, data: bytes) -> str:
    boundary = "tool-boundary-1"
    body = (f'--{boundary}\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n--{boundary}\r\n'
            'Content-Disposition: form-data; name="file"; filename="b.jsonl"\r\n\r\n').encode()
    body += data + f"\r\n--{boundary}--\r\n".encode()
    conn = _conn(port)
    status, raw = _call(conn, "POST", "/v1/files", body, f"multipart/form-data; boundary={boundary}")
    if status != 200:
        raise SystemExit(f"upload failed: {status} {raw[:200]!r}")
    status, raw = _call(conn, "POST", "/v1/batches", json.dumps({"input_file_id": json.loads(raw)["id"]}).encode())
    return json.loads(raw)["id"]


def batch_state(port: int, batch_id: str) -> dict:
    return json.loads(_call(_conn(port), "GET", f"/v1/batches/{batch_id}")[1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model")
    parser.add_argument("--demo", action="store_true")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--seconds", type=float, default=30.0)
    parser.add_argument("--lines", type=int, default=50_000)
    parser.add_argument("--alone-lines", type=int, default=600)
    args = parser.parse_args()
    home = tempfile.mkdtemp(prefix="batch-latency-")
    os.environ["BASAL_LOCAL_HOME"] = home
    target = ["--demo"] if args.demo or not args.model else ["--model", args.model]
    daemon = Daemon([*target, "--device", args.device])
    report: dict = {"clients": args.clients, "seconds": args.seconds, "lines": args.lines}
    try:
        daemon.wait_ready()
        model = json.loads(_call(_conn(daemon.port), "GET", "/health")[1])["models"][0]
        interactive(daemon.port, model, args.clients, 3.0)  # warm-up
        report["without_batch"] = interactive(daemon.port, model, args.clients, args.seconds)
        big = submit(daemon.port, batch_lines(args.lines))
        time.sleep(2.0)  # validation of the big file
        before = batch_state(daemon.port, big)["request_counts"]
        report["with_batch"] = interactive(daemon.port, model, args.clients, args.seconds)
        after = batch_state(daemon.port, big)["request_counts"]
        report["batch_lines_during_interactive"] = (after["completed"] + after["failed"]) - (
            before["completed"] + before["failed"])
        _call(_conn(daemon.port), "POST", f"/v1/batches/{big}/cancel")
        while batch_state(daemon.port, big)["status"] != "cancelled":
            time.sleep(0.2)
        data = batch_lines(args.alone_lines)
        started = time.perf_counter()
        alone = submit(daemon.port, data)
        while batch_state(daemon.port, alone)["status"] not in ("completed", "failed"):
            time.sleep(0.05)
        report["batch_alone_lines_per_s"] = round(args.alone_lines / (time.perf_counter() - started), 1)
        with tempfile.TemporaryDirectory() as tmp:
            src = Path(tmp) / "in.jsonl"
            src.write_text("".join(json.dumps({**json.loads(x)["body"], "model": model}) + "\n"
                                   for x in data.decode().splitlines()))
            started = time.perf_counter()
            subprocess.run([sys.executable, "-m", "basal_local.cli", "run", "--url", f"http://127.0.0.1:{daemon.port}",
                            "--input", str(src), "--output", str(Path(tmp) / "out.jsonl"), "--concurrency", "32"],
                           check=False, capture_output=True, timeout=1800)
            report["run_command_lines_per_s"] = round(args.alone_lines / (time.perf_counter() - started), 1)
    finally:
        daemon.stop()
    print(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

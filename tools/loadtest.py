"""Load test: many clients for minutes, every answer checked against the same request asked alone.

    python tools/loadtest.py [--clients 64] [--seconds 120] [--model DIR] [--device cpu]
    python tools/loadtest.py --kill-every 6 [--clients 16] [--seconds 90] [--replicas 2] [--devices cuda:0,cuda:1]

A daemon on a free port (a generated tiny model unless --model); each sample request of both dialects asked alone
gives the reference; then the clients (fresh connections), every 200 compared with it (text exactly, numbers
within --tolerance), and the daemon's RSS each second. --kill-every S: --replicas worker processes per device; one
worker, then every worker, in turn, gets SIGKILL S seconds after each recovery; a 503 must carry an integer
Retry-After in the dialect's shape. Exit 1 on any other status, a hang, a dropped connection, a mismatch, a
traceback in the daemon's log, or RSS growth above --rss-growth-mb. tools/fuzz.py shares the daemon and sockets.
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

PATHS = ("/v1/systemone", "/v1/basal")


class Daemon:
    """`basal-local serve` on a free port (a generated tiny model unless the args name one); output in `lines`."""

    def __init__(self, args: list[str]) -> None:
        if "--model" not in args:
            from basal_local.model.testmodel import make_test_model

            args = ["--model", str(make_test_model(Path(tempfile.mkdtemp()) / "tiny", preset="tiny", seed=1)), *args]
        from basal_local.model import load_model_dir

        self.model = load_model_dir(args[args.index("--model") + 1], check_weights=False).name
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.proc = subprocess.Popen([sys.executable, "-m", "basal_local.cli", "serve", "--port", str(self.port), *args],
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.lines: list[str] = []
        threading.Thread(target=lambda: self.lines.extend(self.proc.stdout), daemon=True).start()
        atexit.register(self.stop)  # never left running, whatever ends the tool
        deadline = time.time() + 600
        while self.proc.poll() is None and time.time() < deadline:
            try:
                if exchange(self.port, request("GET", "/health"), 2)[0] == 200:
                    return
            except OSError:
                pass
            time.sleep(0.2)
        self.stop()
        raise SystemExit("the daemon did not start:\n" + "".join(self.lines[-20:]))

    def get(self, path: str) -> dict:
        return json.loads(exchange(self.port, request("GET", path), 10)[2])

    def rss_mb(self) -> float:
        lines = Path(f"/proc/{self.proc.pid}/status").read_text().splitlines()
        return next((int(x.split()[1]) / 1024 for x in lines if x.startswith("VmRSS:")), 0.0)

    def stop(self) -> int:
        self.proc.terminate()
        try:
            return self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()


def request(method: str, path: str, body: bytes = b"", headers: dict[str, str] | None = None,
            content_length: int | None = None) -> bytes:
    merged = {"host": "127.0.0.1", "content-type": "application/json",
              **{k.lower(): v for k, v in (headers or {}).items()}}
    if method == "POST":
        merged.setdefault("content-length", str(len(body) if content_length is None else content_length))
    head = [f"{method} {path} HTTP/1.1"] + [f"{k}: {v}" for k, v in merged.items() if v is not None]
    return ("\r\n".join(head) + "\r\n\r\n").encode("latin-1") + body


def exchange(port: int, raw: bytes, deadline_s: float = 60.0, half_close: bool = False,
             hang_up: bool = False) -> tuple[int, dict[str, str], bytes]:
    """Send raw bytes; (status, headers, body). `hang_up`: close right after sending (status 0)."""
    end = time.monotonic() + deadline_s

    def recv() -> bytes:
        if end - time.monotonic() <= 0:
            raise TimeoutError("no answer within the deadline (a hang)")
        sock.settimeout(end - time.monotonic())
        chunk = sock.recv(1 << 16)
        if not chunk:
            raise ConnectionError("closed before a complete answer")
        return chunk

    with socket.create_connection(("127.0.0.1", port), timeout=deadline_s) as sock:
        sock.sendall(raw)
        if hang_up:
            return 0, {}, b""
        if half_close:
            sock.shutdown(socket.SHUT_WR)
        data = b""
        while b"\r\n\r\n" not in data:
            data += recv()
        head, rest = data.split(b"\r\n\r\n", 1)
        lines = head.decode("latin-1").split("\r\n")
        headers = {k.strip().lower(): v.strip() for k, _, v in (x.partition(":") for x in lines[1:])}
        while len(rest) < int(headers.get("content-length", "0")):
            rest += recv()
        return int(lines[0].split()[1]), headers, rest[: int(headers.get("content-length", "0"))]


def sample_bodies(model: str) -> list[bytes]:
    from basal_local.samples import sample_requests

    return [json.dumps({**{k: v for k, v in s.items() if k != "id"}, "model": model}).encode()
            for s in sample_requests()]


def compare(a, b, path: str = "") -> tuple[float, list[str]]:
    """(max numeric difference, differing non-numeric leaves) between two answers."""
    if type(a) in (int, float) and type(b) in (int, float):
        return abs(a - b), []
    if isinstance(a, dict) and isinstance(b, dict) and set(a) == set(b):
        pairs = [(a[k], b[k], f"{path}.{k}") for k in a]
    elif isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        pairs = [(x, y, f"{path}[{i}]") for i, (x, y) in enumerate(zip(a, b))]
    else:
        return 0.0, ([] if a == b else [path])
    worst, diffs = 0.0, []
    for x, y, p in pairs:
        w, d = compare(x, y, p)
        worst, diffs = max(worst, w), diffs + d
    return worst, diffs


def well_formed_503(path: str, headers: dict, body: dict) -> bool:
    if not headers.get("retry-after", "").isdigit() or int(headers["retry-after"]) < 1:
        return False
    return body.get("detail", {}).get("error_type") == "unavailable_error" if path == PATHS[0] else set(body) == {"error"}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--seconds", type=float, default=120)
    parser.add_argument("--model", help="model directory (default: a generated tiny model)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--devices", help="with --kill-every: e.g. cuda:0,cuda:1 (default: --device)")
    parser.add_argument("--kill-every", type=float, default=0, help="seconds between a recovery and the next kill")
    parser.add_argument("--replicas", type=int, default=2, help="with --kill-every: workers per device")
    parser.add_argument("--tolerance", type=float, default=1e-4)
    parser.add_argument("--rss-growth-mb", type=float, default=300)
    args = parser.parse_args()
    serve = ["--model", args.model] if args.model else []
    if args.kill_every:
        serve += ["--devices", args.devices or args.device, "--replicas", str(args.replicas), "--replica-processes"]
    daemon = Daemon(serve + ([] if args.kill_every else ["--device", args.device]))
    cases = [(path, body) for body in sample_bodies(daemon.model) for path in PATHS]
    references = []
    for path, body in cases:  # alone: one request at a time
        status, _, answer = exchange(daemon.port, request("POST", path, body), 120)
        if status != 200:
            daemon.stop()
            sys.exit(f"reference request failed: {status} {answer[:300]!r}")
        references.append(json.loads(answer)["answers"])
    outcomes, health_seen, latencies, problems, kills, worst = Counter(), Counter(), [], [], [], [0.0]
    rss, lock, stop_at = [daemon.rss_mb()], threading.Lock(), time.monotonic() + args.seconds

    def client(seed: int) -> None:
        rng = random.Random(seed)
        while time.monotonic() < stop_at:
            i = rng.randrange(len(cases))
            path, body = cases[i]
            started = time.perf_counter()
            try:
                status, headers, raw = exchange(daemon.port, request("POST", path, body), 120)
                answer = json.loads(raw)
            except Exception as exc:  # a hang or a dropped connection is a failure of the daemon
                with lock:
                    outcomes[type(exc).__name__] += 1
                    problems.append(f"{path}: {type(exc).__name__}: {exc}")
                continue
            with lock:
                outcomes[status] += 1
                latencies.append((time.perf_counter() - started) * 1000)
                if status == 200:
                    diff, leaves = compare(references[i], answer["answers"])
                    worst[0] = max(worst[0], diff)
                    if leaves or diff > args.tolerance:
                        problems.append(f"case {i}: |d|={diff:.2e} {leaves[:3]}")
                elif not (args.kill_every and status == 503 and well_formed_503(path, headers, answer)):
                    problems.append(f"{path}: {status} {headers.get('retry-after')} {raw[:200]!r}")

    def killer() -> None:
        every = False
        while time.monotonic() + args.kill_every < stop_at:
            time.sleep(args.kill_every)
            pids = [r["pid"] for r in daemon.get("/api/stats")["replicas"]]
            victims = pids if every else [random.choice(pids)]
            t0 = time.monotonic()
            for pid in victims:
                os.kill(pid, signal.SIGKILL)
            while time.monotonic() - t0 < 120:  # back: every replica alive in a process that is not a victim
                status, _, health = exchange(daemon.port, request("GET", "/health"), 10)
                health_seen[f"{status} {json.loads(health)['status']}"] += 1
                if all(r["alive"] and r["pid"] not in victims for r in daemon.get("/api/stats")["replicas"]):
                    break
                time.sleep(0.05)
            kills.append(("all" if every else "one", round(time.monotonic() - t0, 1)))
            every = not every

    def sample_rss() -> None:
        while time.monotonic() < stop_at:
            rss.append(daemon.rss_mb())
            time.sleep(1)

    threads = [threading.Thread(target=client, args=(n,)) for n in range(args.clients)]
    threads += [threading.Thread(target=killer if args.kill_every else sample_rss)]
    started = time.time()
    [t.start() for t in threads]
    [t.join() for t in threads]
    elapsed, stats, health = time.time() - started, daemon.get("/api/stats"), daemon.get("/health")
    rc = daemon.stop()
    lat = sorted(latencies) or [0.0]
    result = {
        "clients": args.clients, "seconds": round(elapsed, 1), "requests": sum(outcomes.values()),
        "outcomes": {str(k): v for k, v in sorted(outcomes.items(), key=str)}, "problems": len(problems),
        "max_abs_diff_vs_alone": worst[0], "throughput_rps": round(outcomes[200] / elapsed, 1),
        "latency_ms": {"p50": round(statistics.median(lat), 1), "p99": round(lat[int(0.99 * (len(lat) - 1))], 1),
                       "max": round(lat[-1], 1)},
        "daemon_counters": stats["counters"], "daemon_exit": rc, "health_at_end": health["status"],
        "tracebacks": sum("Traceback" in line for line in daemon.lines),
    }
    if args.kill_every:
        result.update({"kills": len(kills), "recovery_s": kills, "health_while_down": dict(health_seen),
                       "recovery_s_median": statistics.median([s for _, s in kills]) if kills else None,
                       "restarts": [r.get("restarts") for r in stats["replicas"]]})
    else:
        result["rss_mb"] = {"start": round(rss[0]), "max": round(max(rss)), "end": round(rss[-1])}
    for key, value in result.items():
        print(f"{key:>24}: {value}")
    for p in problems[:10]:
        print("PROBLEM", p)
    ok = not problems and rc == 0 and not result["tracebacks"] and health["status"] == "ok"
    return 0 if ok and max(rss) - rss[0] <= args.rss_growth_mb else 1


if __name__ == "__main__":
    sys.exit(main())

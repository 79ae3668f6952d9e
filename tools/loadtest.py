"""Load test: many clients for minutes, every answer checked against the same request asked alone, RSS bounded.

    python tools/loadtest.py [--clients 64] [--seconds 120] [--model DIR] [--device cpu] [--json]

Starts `basal-local serve` (a generated tiny model unless --model), asks each sample request of both
dialects alone to get its reference answer, then runs the clients, each on its own keep-alive-free
connections, and compares every answer with the reference: text fields exactly, numbers within 1e-4
(batching may move the last float bits). Prints the counts, the worst |difference|, latency percentiles and
the daemon's RSS over time; exit 1 on any error, mismatch or an RSS that grew by more than --rss-growth-mb.
Not part of CI: run it by hand and record the figures in docs/RELIABILITY.md.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from netkit import Daemon, exchange, request, sample_requests  # noqa: E402

PATHS = ("/v1/systemone", "/v1/basal")


def compare(a, b, path: str = "") -> tuple[float, list[str]]:
    """(max numeric difference, differing non-numeric leaves) between two answers."""
    if isinstance(a, bool) or isinstance(b, bool) or isinstance(a, str) or a is None:
        return 0.0, ([] if a == b else [path])
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return abs(a - b), []
    if isinstance(a, dict) and isinstance(b, dict):
        if set(a) != set(b):
            return 0.0, [path + "{keys}"]
        worst, diffs = 0.0, []
        for k in a:
            w, d = compare(a[k], b[k], f"{path}.{k}")
            worst, diffs = max(worst, w), diffs + d
        return worst, diffs
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        worst, diffs = 0.0, []
        for i, (x, y) in enumerate(zip(a, b)):
            w, d = compare(x, y, f"{path}[{i}]")
            worst, diffs = max(worst, w), diffs + d
        return worst, diffs
    return 0.0, [path]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--seconds", type=float, default=120)
    parser.add_argument("--model", help="model directory (default: a generated tiny model)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--tolerance", type=float, default=1e-4)
    parser.add_argument("--rss-growth-mb", type=float, default=300)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    model_dir = args.model
    if model_dir is None:
        from basal_local.model.testmodel import make_test_model

        model_dir = str(make_test_model(Path(tempfile.mkdtemp()) / "tiny", preset="tiny", seed=1))
    from basal_local.model import load_model_dir

    name = load_model_dir(model_dir, check_weights=False).name
    daemon = Daemon(["--model", model_dir, "--device", args.device])
    daemon.wait_ready()
    cases = [(path, json.dumps({**s, "model": name}).encode()) for s in sample_requests() for path in PATHS]

    def ask(case) -> tuple[int, dict]:
        status, _, body = exchange(daemon.port, request("POST", case[0], case[1]), 120)
        return status, json.loads(body)

    references = []
    for case in cases:  # alone: one request at a time
        status, body = ask(case)
        if status != 200:
            daemon.stop()
            sys.exit(f"reference request failed: {status} {body}")
        references.append(body["answers"])
    rss_start = daemon.rss_mb()
    rss: list[float] = [rss_start]
    statuses: Counter = Counter()
    latencies: list[float] = []
    mismatches: list[str] = []
    worst = [0.0]
    lock = threading.Lock()
    stop_at = time.monotonic() + args.seconds

    def client(seed: int) -> None:
        rng = random.Random(seed)
        while time.monotonic() < stop_at:
            i = rng.randrange(len(cases))
            started = time.perf_counter()
            try:
                status, body = ask(cases[i])
            except Exception as exc:  # a hang or a dropped connection is a failure of the daemon
                with lock:
                    statuses[type(exc).__name__] += 1
                continue
            elapsed = (time.perf_counter() - started) * 1000
            with lock:
                statuses[status] += 1
                latencies.append(elapsed)
                if status == 200:
                    diff, leaves = compare(references[i], body["answers"])
                    worst[0] = max(worst[0], diff)
                    if leaves or diff > args.tolerance:
                        mismatches.append(f"case {i}: |d|={diff:.2e} {leaves[:3]}")

    def sample_rss() -> None:
        while time.monotonic() < stop_at:
            rss.append(daemon.rss_mb())
            time.sleep(1)

    threads = [threading.Thread(target=client, args=(n,)) for n in range(args.clients)]
    threads.append(threading.Thread(target=sample_rss))
    started = time.time()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = time.time() - started
    stats = json.loads(exchange(daemon.port, request("GET", "/api/stats"), 10)[2])
    rc = daemon.stop()
    answered = statuses.get(200, 0)
    lat = sorted(latencies) or [0.0]
    result = {
        "clients": args.clients, "seconds": round(elapsed, 1), "requests": sum(statuses.values()),
        "answered_200": answered, "statuses": {str(k): v for k, v in statuses.items()},
        "mismatches": len(mismatches), "max_abs_diff_vs_alone": worst[0],
        "throughput_rps": round(answered / elapsed, 1),
        "latency_ms": {"p50": round(statistics.median(lat), 1), "p99": round(lat[int(0.99 * (len(lat) - 1))], 1),
                       "max": round(lat[-1], 1)},
        "rss_mb": {"start": round(rss_start), "max": round(max(rss)), "end": round(rss[-1])},
        "daemon_counters": stats["counters"], "daemon_exit": rc,
    }
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        for key, value in result.items():
            print(f"{key:>24}: {value}")
        for m in mismatches[:10]:
            print("MISMATCH", m)
    ok = (answered == result["requests"] and not mismatches and rc == 0
          and max(rss) - rss_start <= args.rss_growth_mb)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

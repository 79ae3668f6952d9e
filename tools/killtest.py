"""Kill replica worker processes (kill -9) under load: every answer is right or a 503 + Retry-After, none hangs.

    python tools/killtest.py [--clients 16] [--seconds 90] [--every 6] [--replicas 2] [--devices cuda:0,cuda:1]

Starts `basal-local serve --replicas N --replica-processes` on a generated tiny model (CPU), asks each sample
request of both dialects alone for its reference answer, then runs the clients (a fresh connection per request)
while a killer sends SIGKILL to one worker, then to every worker, in turn, every `--every` seconds once /health
says ok again. Every 200 is compared with its reference (text exactly, numbers within 1e-4); a 503 must carry an
integer Retry-After and the dialect's shape; anything else (500, a hang, a dropped connection) is a failure.
Prints the counts, the recovery times (kill -> /health ok with every worker back) and exits 1 on any failure.
Not part of CI: run it by hand and record the figures in docs/RELIABILITY.md.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from loadtest import compare  # noqa: E402
from netkit import Daemon, exchange, request, sample_requests  # noqa: E402

PATHS = ("/v1/systemone", "/v1/basal")


def get(port: int, path: str) -> tuple[int, dict]:
    status, _, body = exchange(port, request("GET", path), 10)
    return status, json.loads(body)


def well_formed_503(path: str, headers: dict, body: dict) -> bool:
    if not headers.get("retry-after", "").isdigit() or int(headers["retry-after"]) < 1:
        return False
    if path == "/v1/systemone":
        return body.get("detail", {}).get("error_type") == "unavailable_error"
    return set(body) == {"error"}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--seconds", type=float, default=90)
    parser.add_argument("--every", type=float, default=6, help="seconds between a recovery and the next kill")
    parser.add_argument("--replicas", type=int, default=2, help="workers per device")
    parser.add_argument("--devices", help="e.g. cuda:0,cuda:1 (default: the CPU)")
    parser.add_argument("--model", help="model directory (default: a generated tiny model)")
    parser.add_argument("--tolerance", type=float, default=1e-4)
    args = parser.parse_args()
    from basal_local.model import load_model_dir
    from basal_local.model.testmodel import make_test_model

    model_dir = args.model or str(make_test_model(Path(tempfile.mkdtemp()) / "tiny", preset="tiny", seed=1))
    name = load_model_dir(model_dir, check_weights=False).name
    where = ["--devices", args.devices] if args.devices else ["--device", "cpu"]
    daemon = Daemon(["--model", model_dir, *where, "--replicas", str(args.replicas), "--replica-processes"])
    daemon.wait_ready()
    cases = [(path, json.dumps({**s, "model": name}).encode()) for s in sample_requests() for path in PATHS]
    references = []
    for path, body in cases:
        status, _, answer = exchange(daemon.port, request("POST", path, body), 120)
        if status != 200:
            daemon.stop()
            sys.exit(f"reference request failed: {status} {answer[:300]!r}")
        references.append(json.loads(answer)["answers"])
    outcomes: Counter = Counter()
    problems: list[str] = []
    worst = [0.0]
    lock = threading.Lock()
    stop_at = time.monotonic() + args.seconds

    def client(seed: int) -> None:
        rng = random.Random(seed)
        while time.monotonic() < stop_at:
            i = rng.randrange(len(cases))
            path, body = cases[i]
            try:
                status, headers, raw = exchange(daemon.port, request("POST", path, body), 60)
                answer = json.loads(raw)
            except Exception as exc:  # a hang or a dropped connection
                with lock:
                    outcomes[type(exc).__name__] += 1
                    problems.append(f"{path}: {type(exc).__name__}: {exc}")
                continue
            with lock:
                outcomes[status] += 1
                if status == 200:
                    diff, leaves = compare(references[i], answer["answers"])
                    worst[0] = max(worst[0], diff)
                    if leaves or diff > args.tolerance:
                        problems.append(f"case {i}: |d|={diff:.2e} {leaves[:3]}")
                elif status != 503 or not well_formed_503(path, headers, answer):
                    problems.append(f"{path}: {status} {headers.get('retry-after')} {raw[:200]!r}")

    kills: list[tuple[str, float]] = []  # (what, seconds until /health ok again)
    health_seen: Counter = Counter()

    def killer() -> None:
        both = False
        while time.monotonic() + args.every < stop_at:
            time.sleep(args.every)
            pids = [r["pid"] for r in get(daemon.port, "/api/stats")[1]["replicas"]]
            victims = pids if both else [random.choice(pids)]
            t0 = time.monotonic()
            for pid in victims:
                os.kill(pid, signal.SIGKILL)
            while time.monotonic() - t0 < 120:  # back: every replica alive in a process that is not a victim
                status, health = get(daemon.port, "/health")
                health_seen[(status, health["status"])] += 1
                replicas = get(daemon.port, "/api/stats")[1]["replicas"]
                if all(r["alive"] and r["pid"] not in victims for r in replicas):
                    break
                time.sleep(0.05)
            kills.append(("all" if both else "one", time.monotonic() - t0))
            both = not both

    threads = [threading.Thread(target=client, args=(n,)) for n in range(args.clients)]
    threads.append(threading.Thread(target=killer))
    started = time.time()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = time.time() - started
    _, stats = get(daemon.port, "/api/stats")
    _, health = get(daemon.port, "/health")
    rc = daemon.stop()
    tracebacks = sum("Traceback" in line for line in daemon.lines)
    recovered = {what: [round(s, 1) for w, s in kills if w == what] for what in ("one", "all")}
    result = {
        "clients": args.clients, "seconds": round(elapsed, 1), "replicas": args.replicas,
        "requests": sum(outcomes.values()), "outcomes": {str(k): v for k, v in sorted(outcomes.items(), key=str)},
        "max_abs_diff_vs_alone": worst[0], "kills": len(kills),
        "recovery_s_one_killed": recovered["one"], "recovery_s_all_killed": recovered["all"],
        "recovery_s_median": round(statistics.median([s for _, s in kills]), 1) if kills else None,
        "health_while_down": {f"{s} {w}": n for (s, w), n in sorted(health_seen.items())},
        "restarts": [r.get("restarts") for r in stats["replicas"]], "health_at_end": health["status"],
        "daemon_exit": rc, "tracebacks": tracebacks, "problems": len(problems),
    }
    for key, value in result.items():
        print(f"{key:>24}: {value}")
    for p in problems[:10]:
        print("PROBLEM", p)
    return 0 if not problems and rc == 0 and not tracebacks and health["status"] == "ok" else 1


if __name__ == "__main__":
    sys.exit(main())

"""Retries that land: bursts of concurrent clients against a daemon with a small --max-inflight.

    python tools/retry_bursts.py [--bursts 50] [--clients 20] [--max-inflight 1] [--wait-ms 100]
                                 [--client sdk|integer|none] [--python PY] [--json]

Starts `basal-local serve` on 127.0.0.1 (a generated tiny model on the CPU unless --model) and fires --bursts
bursts of --clients simultaneous calls, one burst after the other. `sdk`: the published typesafe-sdk with its
default retry policy (3 attempts, honours retry-after-ms); `integer`: a client that reads only the whole-second
`Retry-After`, 3 attempts; `none`: no retries. Prints per-burst successes (min / mean / bursts with all),
529s, and the latency of the attempts that were answered 200 (p50 / p99, from sending the attempt).
`--python` runs the daemon with another interpreter (e.g. another checkout's venv, for a before/after).
Bounded: every call gives up after 3 attempts or 40 s. Figures go to docs/RELIABILITY.md.
"""

from __future__ import annotations

import argparse
import http.client
import json
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from netkit import Daemon  # noqa: E402

STATE = "The parcel arrived late and the box was damaged."
QUESTIONS = {"late": {"type": "noul", "instructions": "Is the order late?"},
             "tone": {"type": "choice", "instructions": "Tone?", "criteria": {"calm": None, "angry": "Hostile"}},
             "urgency": {"type": "score", "instructions": "How urgent?", "criteria": ["low", "mid", "high"]}}


def post(port: int, body: bytes, headers: dict[str, str]) -> tuple[int, dict[str, str], float]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=40)
    try:
        t = time.perf_counter()
        conn.request("POST", "/v1/systemone", body, {"content-type": "application/json", **headers})
        resp = conn.getresponse()
        resp.read()
        return resp.status, {k.lower(): v for k, v in resp.getheaders()}, time.perf_counter() - t
    finally:
        conn.close()


def integer_client(port: int, body: bytes, attempts: int, retry: bool, ok_latency: list[float]) -> bool:
    """Honours only the integer Retry-After (never retry-after-ms); marks nothing."""
    for attempt in range(attempts if retry else 1):
        status, headers, seconds = post(port, body, {})
        if status == 200:
            ok_latency.append(seconds)
            return True
        if status != 529 or attempt == attempts - 1:
            return False
        time.sleep(min(int(headers.get("retry-after", "1")), 30))
    return False


def sdk_client(port: int, model: str, ok_latency: list[float]) -> bool:
    import httpx2
    from typesafe_sdk import TypeSafeClient

    def stamp(request):
        request.extensions["sent"] = time.perf_counter()

    def record(response):
        if response.status_code == 200:
            ok_latency.append(time.perf_counter() - response.request.extensions["sent"])

    http_client = httpx2.Client(event_hooks={"request": [stamp], "response": [record]}, timeout=10)
    try:
        with TypeSafeClient(base_url=f"http://127.0.0.1:{port}", api_key="local", model=model, compression=False,
                            http_client=http_client) as client:
            client.system_one(state=STATE, questions=QUESTIONS)
        return True
    except Exception:
        return False
    finally:
        http_client.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bursts", type=int, default=50)
    parser.add_argument("--clients", type=int, default=20)
    parser.add_argument("--max-inflight", type=int, default=1)
    parser.add_argument("--wait-ms", type=float, default=None, help="--admission-wait-ms (default: the daemon's)")
    parser.add_argument("--client", choices=("sdk", "integer", "none"), default="sdk")
    parser.add_argument("--model", help="model directory (default: a generated tiny model)")
    parser.add_argument("--python", default=sys.executable, help="interpreter that runs the daemon")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    args.bursts = min(args.bursts, 200)
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model
        if model is None:
            from basal_local.model.testmodel import make_test_model

            model = str(Path(tmp) / "tiny")
            make_test_model(Path(model))
        extra = [] if args.wait_ms is None else ["--admission-wait-ms", str(args.wait_ms)]
        daemon = Daemon(["--model", model, "--device", "cpu", "--max-inflight", str(args.max_inflight), *extra],
                        python=args.python, cwd=tmp)  # not this checkout: `-m` imports from the cwd
        try:
            daemon.wait_ready()
            conn = http.client.HTTPConnection("127.0.0.1", daemon.port, timeout=10)
            conn.request("GET", "/health")
            name = json.loads(conn.getresponse().read())["models"][0]
            conn.close()
            body = json.dumps({"model": name, "state": STATE, "questions": QUESTIONS}).encode()
            for _ in range(3):  # warm
                post(daemon.port, body, {})
            per_burst, latency, t0 = [], [], time.perf_counter()
            for _ in range(args.bursts):
                results: list[bool] = []
                barrier = threading.Barrier(args.clients)

                def one(barrier=barrier, results=results):
                    barrier.wait()
                    if args.client == "sdk":
                        results.append(sdk_client(daemon.port, name, latency))
                    else:
                        results.append(integer_client(daemon.port, body, 3, args.client == "integer", latency))

                threads = [threading.Thread(target=one) for _ in range(args.clients)]
                for t in threads:
                    t.start()
                for t in threads:
                    t.join(60)
                per_burst.append(sum(results))
            conn = http.client.HTTPConnection("127.0.0.1", daemon.port, timeout=10)
            conn.request("GET", "/api/stats")
            stats = json.loads(conn.getresponse().read())
            conn.close()
        finally:
            daemon.stop()
    latency.sort()
    out = {"client": args.client, "bursts": args.bursts, "clients": args.clients, "max_inflight": args.max_inflight,
           "wait_ms": args.wait_ms, "min_ok": min(per_burst), "mean_ok": round(statistics.mean(per_burst), 2),
           "bursts_all_ok": sum(n == args.clients for n in per_burst), "overloaded": stats["totals"]["overloaded"],
           "p50_ms": round(latency[len(latency) // 2] * 1000, 1) if latency else None,
           "p99_ms": round(latency[min(len(latency) - 1, int(len(latency) * 0.99))] * 1000, 1) if latency else None,
           "seconds": round(time.perf_counter() - t0, 1), "admission": stats.get("admission")}
    print(json.dumps(out) if args.json else
          f"{args.client}: {args.bursts} bursts of {args.clients} vs --max-inflight {args.max_inflight}: ok per burst "
          f"min {out['min_ok']} mean {out['mean_ok']}, all ok in {out['bursts_all_ok']}; {out['overloaded']} 529s; "
          f"200s p50 {out['p50_ms']} ms p99 {out['p99_ms']} ms ({out['seconds']} s); admission {out['admission']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""`basal-local bench --http URL`: closed-loop HTTP load on a running daemon, and the invariance check over HTTP.

Each client sends the sample set's questions one per request. A 529 waits the daemon's Retry-After and sends
again (counted as retried, not failed); a daemon that goes away stops every client at once, and so does Ctrl-C.
"""

from __future__ import annotations

import collections
import http.client
import json
import random
import sys
import threading
import time
import urllib.parse
from typing import Any

from ..samples import single_question_requests
from . import UserError, auth_headers, get_json
from .ask import error_text, post
from .benchout import answer_timings, percentile

MAX_RETRIES = 20  # 529s for one request before it counts as failed
GONE_AFTER = 3  # connection failures in a row that mean the daemon is gone


class Refused(Exception):
    """A non-200 answer: its status, its reason for the summary and the Retry-After (seconds) of a 529."""

    def __init__(self, status: int, reason: str, retry_s: float = 0.0) -> None:
        super().__init__(reason)
        self.status, self.reason, self.retry_s = status, reason, retry_s


def retry_after_s(headers: Any) -> float:
    """retry-after-ms (the slot the daemon gives), else Retry-After in seconds, else one second."""
    for name, scale in (("retry-after-ms", 1000.0), ("retry-after", 1.0)):
        value = headers.get(name)
        if value:
            try:
                return max(0.0, float(value) / scale)
            except ValueError:
                pass
    return 1.0


class Client:
    """One benchmark client's connection: kept alive between requests as SDKs do, or new for each request."""

    def __init__(self, url: str, keep_alive: bool, api_key: str | None = None) -> None:
        parts = urllib.parse.urlsplit(url)
        self.host, self.port, self.keep_alive = parts.hostname or "127.0.0.1", parts.port, keep_alive
        self.https = parts.scheme == "https"
        self.headers = {"Content-Type": "application/json", **auth_headers(api_key)}
        self.conn: http.client.HTTPConnection | None = None
        self.timings: tuple[float | None, ...] = (None, None)

    def post(self, path: str, data: bytes) -> tuple[bytes, int]:
        """(body, x-basal-batch-requests) of a 200 answer (`self.timings`: its x-basal-queue-ms and
        x-basal-compute-ms); raises Refused on another status, OSError when the connection fails."""
        if self.conn is None:
            kind = http.client.HTTPSConnection if self.https else http.client.HTTPConnection
            self.conn = kind(self.host, self.port, timeout=600)
        try:
            self.conn.request("POST", path, data, self.headers)
            resp = self.conn.getresponse()
            body = resp.read()
        except (OSError, http.client.HTTPException) as exc:
            self.conn.close()
            self.conn = None
            raise OSError(str(exc) or type(exc).__name__) from exc
        finally:
            if not self.keep_alive and self.conn is not None:
                self.conn.close()
                self.conn = None
        if resp.status != 200:
            try:
                message = json.loads(body).get("error") or json.loads(body).get("detail", {}).get("message", "")
            except (ValueError, AttributeError):
                message = ""
            raise Refused(resp.status, f"HTTP {resp.status}" + (f": {str(message)[:80]}" if message else ""),
                          retry_after_s(resp.headers) if resp.status == 529 else 0.0)
        self.timings = answer_timings(resp.headers)
        return body, int(resp.headers.get("x-basal-batch-requests", "1"))


def loaded_default(url: str, api_key: str | None) -> str:
    """The daemon's default model, loaded first when it is not (an unloaded model would answer 503s)."""

    info = get_json(url, "/api/ps", timeout=30, flag="--http", api_key=api_key)
    default = next((m for m in info.get("models", []) if m.get("default")), None) or \
        next(iter(info.get("models", [])), None)
    if default is None:
        raise UserError(f"the daemon at {url} serves no model", "load one: basal-local load mini")
    if default.get("status", "loaded") != "loaded":
        print(f"basal-local bench: loading {default['name']} first (it is {default['status']})", file=sys.stderr,
              flush=True)
        status, answer = post(url, "/api/load", {"model": default["name"], "wait": True}, timeout=900.0,
                              api_key=api_key)
        if status != 200:
            raise UserError(f"the daemon could not load {default['name']}: {error_text(answer)}",
                            "see its log (`basal-local logs`)", status=1)
    return default["name"]


def bench_http(url: str, clients: int, total: int, keep_alive: bool = True, api_key: str | None = None,
               progress=None) -> dict[str, Any]:
    url = url.rstrip("/")
    model = loaded_default(url, api_key)
    bodies = single_question_requests(model)
    total = total or len(bodies)
    answered: list[tuple] = []  # per 200: (sent s, latency ms, queue ms, compute ms, batch requests)
    failures: collections.Counter[str] = collections.Counter()
    retried = [0]
    lock = threading.Lock()
    counter = iter(range(total))
    stop = threading.Event()
    gone = threading.Event()

    def client() -> None:
        conn = Client(url, keep_alive, api_key)
        in_a_row = 0
        while not stop.is_set():
            with lock:
                n = next(counter, None)
            if n is None:
                return
            data = json.dumps(bodies[n % len(bodies)]).encode()
            for _ in range(MAX_RETRIES + 1):
                t = time.perf_counter()
                try:
                    _, size = conn.post("/v1/systemone", data)
                except Refused as exc:
                    if exc.status == 529 and not stop.is_set():
                        with lock:
                            retried[0] += 1
                        stop.wait(exc.retry_s)  # the daemon said when a slot frees up
                        continue
                    reason = exc.reason
                except OSError as exc:
                    in_a_row += 1
                    if in_a_row >= GONE_AFTER:
                        gone.set()
                        stop.set()
                    reason = f"connection failed ({exc})"
                else:
                    in_a_row = 0
                    with lock:
                        answered.append((t - t0, (time.perf_counter() - t) * 1000.0, *conn.timings, size))
                    break
                with lock:
                    failures[reason] += 1
                break
            else:
                with lock:
                    failures["HTTP 529 after every retry"] += 1
            if progress is not None:
                progress(len(answered) + sum(failures.values()), total)

    threads = [threading.Thread(target=client, daemon=True) for _ in range(clients)]
    t0 = time.perf_counter()
    for th in threads:
        th.start()
    try:
        for th in threads:
            while th.is_alive():
                th.join(timeout=0.2)  # a timed join: Ctrl-C reaches this thread at once
    except KeyboardInterrupt:
        stop.set()  # no client sends another request; those in flight are abandoned
        raise
    elapsed = time.perf_counter() - t0
    latencies = [a[1] for a in answered]
    result: dict[str, Any] = {"mode": "http", "url": url, "clients": clients, "requests": len(latencies),
                              "errors": sum(failures.values()), "retried_529": retried[0], "keep_alive": keep_alive}
    if failures:
        result["errors_by_reason"] = dict(failures.most_common())
    if gone.is_set():
        result["daemon_gone"] = True
    if not latencies:
        result["error"] = "no request succeeded"
        return result
    result.update({"req_per_s": round(len(latencies) / elapsed, 2),
                   "latency_ms": {"p50": round(percentile(latencies, .5), 2),
                                  "p95": round(percentile(latencies, .95), 2),
                                  "p99": round(percentile(latencies, .99), 2)},
                   "mean_batch_requests": round(sum(a[4] for a in answered) / len(answered), 2)})
    # the slowest 1 % as the daemon timed them: a tail of queue waits (batch forming) or of long batches?
    slowest = sorted(answered, key=lambda a: -a[1])[:max(1, len(answered) // 100)]
    result["slowest"] = [{"sent_s": round(a[0], 3), "latency_ms": round(a[1], 2), "queue_ms": a[2],
                          "compute_ms": a[3], "batch_requests": a[4]} for a in sorted(slowest)]
    return result


def _post_basal(url: str, body: dict[str, Any], api_key: str | None) -> tuple[dict[str, Any], int]:
    raw, size = Client(url, False, api_key).post("/v1/basal", json.dumps(body).encode())
    return json.loads(raw), size


def bench_http_invariance(url: str, trials: int, api_key: str | None = None) -> dict[str, Any]:
    """Over HTTP: a request's answers alone, then again sent at the same moment as 31 others (so they share
    batches); the probabilities must be the same bits (JSON floats print every bit of a float64)."""
    url = url.rstrip("/")
    model = loaded_default(url, api_key)
    bodies = single_question_requests(model)
    rng = random.Random(0)
    equal, batches = 0, []
    for _ in range(trials):
        target = rng.choice(bodies)
        alone, _ = _post_basal(url, target, api_key)
        others = rng.sample([b for b in bodies if b is not target], 31)
        barrier = threading.Barrier(32)
        got: dict[str, Any] = {}

        def send(body, mine: bool, barrier=barrier, got=got) -> None:
            barrier.wait()
            out, size = _post_basal(url, body, api_key)
            if mine:
                got["answers"], got["batch"] = out["answers"], size

        threads = [threading.Thread(target=send, args=(b, False)) for b in others[:15]]
        threads.append(threading.Thread(target=send, args=(target, True)))
        threads += [threading.Thread(target=send, args=(b, False)) for b in others[15:]]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        equal += got.get("answers") == alone["answers"]
        batches.append(got.get("batch", 0))
    return {"trials": trials, "bitwise_equal": equal, "batch_requests_of_target": batches}

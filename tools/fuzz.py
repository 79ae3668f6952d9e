"""Fuzz a daemon with hostile and odd requests over raw sockets; print the counts by kind and status.

    python tools/fuzz.py [--inputs 10000] [--threads 8] [--seed 0] [--seconds N] [--model DIR | --port PORT]

Starts `basal-local serve` on a generated tiny model (or uses a running daemon on --port), sends each
input on a fresh connection with a deadline, and fails (exit 1) on any 5xx, any hang, any connection closed
without an answer where one was due, or a daemon that stops answering /health.
"""

from __future__ import annotations

import argparse
import gzip
import json
import random
import sys
import threading
import time
import zlib
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from loadtest import PATHS, Daemon, exchange, request, sample_bodies  # noqa: E402

TYPES = ["choice", "noul", "score", "multi", "act", "rank", "", None, 5, [], {}]


def rand_json(rng: random.Random, depth: int = 0):
    roll = rng.random()
    if depth > 3 or roll < 0.4:
        return rng.choice([None, True, False, rng.randint(-10**6, 10**6), rng.random() * 1e6, "",
                           "".join(rng.choice("abcąęół \"\\\n\t{}[]") for _ in range(rng.randint(0, 20)))])
    if roll < 0.7:
        return [rand_json(rng, depth + 1) for _ in range(rng.randint(0, 4))]
    return {rng.choice(["a", "type", "state", "criteria", "q", ""]): rand_json(rng, depth + 1)
            for _ in range(rng.randint(0, 4))}


def rand_request(rng: random.Random, model: str) -> dict:
    body: dict = {}
    if rng.random() < 0.9:
        body["model"] = rng.choice([model, model, "nope", 7, None])
    if rng.random() < 0.9:
        body["state"] = rng.choice(["The parcel arrived broken.", "Paczka dotarła uszkodzona.", rand_json(rng)])
    questions = {}
    for i in range(rng.randint(0, 4)):
        q: dict = {"type": rng.choice(TYPES)}
        if rng.random() < 0.8:
            q["instructions"] = rng.choice(["Is this urgent?", rand_json(rng)])
        if rng.random() < 0.8:
            n = rng.randint(0, 14)
            q["criteria"] = rng.choice([{f"k{j}": rng.choice([f"option {j}", None, rand_json(rng)]) for j in range(n)},
                                        [f"o{j}" for j in range(n)], rand_json(rng)])
        if rng.random() < 0.1:
            q["option_keys"] = rng.choice(["show", "hide", "x"])
        questions[rng.choice([f"q{i}", "", "ą"])] = q
    if rng.random() < 0.95:
        body["questions"] = questions if rng.random() < 0.9 else rand_json(rng)
    return body


def mutate(rng: random.Random, data: bytes) -> bytes:
    out = bytearray(data)
    for _ in range(rng.randint(1, 6)):
        at = rng.randint(0, len(out))
        out[at: at + rng.randint(0, 5)] = bytes(rng.randint(0, 255) for _ in range(rng.randint(0, 4)))
    return bytes(out)


class Inputs:
    """Each kind makes one input: (kind, raw request bytes, how to send, statuses that are acceptable)."""

    def __init__(self, model: str) -> None:
        self.model = model
        self.samples = sample_bodies(model)
        bomb = zlib.compressobj(9, zlib.DEFLATED, 31)
        self.gzip_bomb = b"".join(bomb.compress(bytes(1 << 20)) for _ in range(64)) + bomb.flush()

    def make(self, rng: random.Random) -> tuple[str, bytes, dict]:
        path = rng.choice(PATHS)
        kind = rng.choices(list(KINDS), weights=list(KINDS.values()))[0]
        post = lambda body, **h: request("POST", path, body, h)  # noqa: E731
        if kind == "valid":
            return kind, post(rng.choice(self.samples)), {}
        if kind == "structured":
            return kind, post(json.dumps(rand_request(rng, self.model)).encode()), {}
        if kind == "mutated":
            return kind, post(mutate(rng, rng.choice(self.samples))), {}
        if kind == "random_bytes":
            return kind, post(bytes(rng.randint(0, 255) for _ in range(rng.randint(0, 400)))), {}
        if kind == "deep_nesting":
            n = rng.choice([129, 326, 1000, 50_000])
            open_, close = rng.choice([("[", "]"), ('{"a":', "}")])
            return kind, post((open_ * n + "1" + close * n).encode()), {}
        if kind == "huge_int":
            return kind, post(b'{"state": "s", "n": ' + b"9" * rng.randint(4301, 20000) + b"}"), {}
        if kind == "bad_encoding":
            good = gzip.compress(rng.choice(self.samples))
            choice = rng.randint(0, 3)
            if choice == 0:
                return kind, post(good[: rng.randint(1, len(good) - 1)], **{"content-encoding": "gzip"}), {}
            if choice == 1:
                return kind, post(mutate(rng, good), **{"content-encoding": "gzip"}), {}
            if choice == 2:
                return kind, post(mutate(rng, good), **{"content-encoding": "zstd"}), {}
            return kind, post(good, **{"content-encoding": rng.choice(["br", "deflate", "gzip, br"])}), {}
        if kind == "bomb":
            return kind, post(self.gzip_bomb, **{"content-encoding": "gzip"}), {}
        if kind == "length_lie":  # says more than it sends: the body timeout answers 408
            body = rng.choice(self.samples)
            return kind, request("POST", path, body, content_length=len(body) + rng.randint(1, 100)), {}
        if kind == "oversize_length":
            return kind, request("POST", path, b"", content_length=rng.choice([32 * 2**20 + 1, 10**12])), {}
        if kind == "oversize_body":  # the whole body sent before reading: the 413 must come back, not a reset
            size = rng.choice([33, 40, 60]) * 2**20
            return kind, request("POST", path, b'{"state": "' + b"x" * size + b'"}'), {}
        if kind == "hostile_headers":
            headers = rng.choice([{"host": "evil.example"}, {"origin": "http://evil.example"},
                                  {"content-type": "text/plain"}, {"content-type": "multipart/form-data"},
                                  {"content-length": "abc"}, {"origin": "null"}])
            return kind, request("POST", path, rng.choice(self.samples), headers), {}
        if kind == "half_close":
            return kind, post(rng.choice(self.samples)), {"half_close": True}
        if kind == "hang_up":  # half a body, then gone
            body = rng.choice(self.samples)
            return kind, request("POST", path, body[: len(body) // 2], content_length=len(body)), {"hang_up": True}
        raise AssertionError(kind)


KINDS = {"valid": 10, "structured": 25, "mutated": 20, "random_bytes": 8, "deep_nesting": 4, "huge_int": 3,
         "bad_encoding": 8, "bomb": 1, "length_lie": 1, "oversize_length": 3, "oversize_body": 0.3,
         "hostile_headers": 8, "half_close": 4, "hang_up": 5}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--inputs", type=int, default=10_000)
    parser.add_argument("--threads", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--model", help="model directory (default: a generated tiny model)")
    parser.add_argument("--port", type=int, help="fuzz a daemon already running on this port")
    parser.add_argument("--seconds", type=float, default=0, help="stop sending new inputs after this long "
                        "(0: send them all) and report what was sent")
    args = parser.parse_args()
    daemon, port, model_name = None, args.port, "basal-test-tiny"
    if port is None:
        daemon = Daemon([*(["--model", args.model] if args.model else []), "--device", "cpu", "--body-timeout", "1"])
        port, model_name = daemon.port, daemon.model
    inputs = Inputs(model_name)
    counts, problems, lock, started = Counter(), [], threading.Lock(), time.time()

    def one(i: int) -> None:
        if args.seconds and time.time() - started > args.seconds:
            return
        rng = random.Random(args.seed * 1_000_003 + i)
        kind, raw, how = inputs.make(rng)
        try:
            status = exchange(port, raw, 60, **how)[0]
            outcome = str(status) if status else "sent"
            bad = status >= 500
        except TimeoutError:
            outcome, bad = "HANG", True
        except (ConnectionError, OSError) as exc:
            outcome, bad = f"closed:{type(exc).__name__}", True
        with lock:
            counts[(kind, outcome)] += 1
            if bad and len(problems) < 20:
                problems.append(f"input {i} ({kind}): {outcome}: {raw[:200]!r}")

    with ThreadPoolExecutor(args.threads) as pool:
        list(pool.map(one, range(args.inputs)))
    elapsed = time.time() - started
    sent = sum(counts.values())
    alive = exchange(port, request("GET", "/health"), 10)[0] == 200
    by_kind: dict[str, Counter] = {}
    for (kind, outcome), n in counts.items():
        by_kind.setdefault(kind, Counter())[outcome] = n
    print(f"{sent} inputs in {elapsed:.0f} s ({sent / elapsed:.0f}/s), {args.threads} threads, seed {args.seed}")
    print(f"{'kind':<17}{'inputs':>7}  outcomes (HTTP status: count)")
    for kind in KINDS:
        if c := by_kind.get(kind):
            print(f"{kind:<17}{sum(c.values()):>7}  " + ", ".join(f"{o}: {n}" for o, n in sorted(c.items())))
    total = sum(by_kind.values(), Counter())
    print("all statuses:", ", ".join(f"{o}: {n}" for o, n in sorted(total.items())))
    print(f"daemon still answering /health: {alive}")
    if daemon is not None:
        rc = daemon.stop()
        tracebacks = sum("Traceback" in line for line in daemon.lines)
        print(f"daemon exit code {rc}, tracebacks in its log: {tracebacks}")
        if tracebacks or rc != 0:
            problems.append(f"daemon exit {rc}, {tracebacks} tracebacks")
    for p in problems:
        print("PROBLEM", p)
    return 1 if problems or not alive else 0


if __name__ == "__main__":
    sys.exit(main())

"""A/B: does an attached dashboard slow the daemon down? Bench figures without and with a listener, in pairs.

    python tools/ab_dashboard.py [--pairs 3] [--requests 1500] [--clients 16] [--listener sse|top]
                                 [--model DIR] [--device cpu] [--json]
    python tools/ab_dashboard.py --tree-cost

Starts one `basal-local serve --demo` (the generated tiny demo model unless --model: the smallest compute per
request, so the telemetry's share of the time is the largest; the same setup as the HTTP figures of
docs/PERFORMANCE.md), warms it up, then runs
`basal-local bench --http URL --clients C --requests N --json` in pairs: A without a listener, B with one.
The order inside a pair alternates (AB, BA, AB, ...) so that a drift of the machine hits both sides alike.
The listener of a B run:
  sse  an /api/events reader (every event serialized, every batch tree built) plus an /api/stats poll each
       second: what `basal-local top` asks of the daemon, without its drawing;
  top  `basal-local top` itself, headless (Textual without a terminal) in its own process.
Prints req/s, p50 and p99 of every run, the events the listener read and the trees the daemon built during
the run, then the medians and the ratios B/A, and how long the whole measurement took. Exit 1 when a bench
run failed. Not part of CI: run it by hand on a quiet machine; figures go to docs/PERFORMANCE.md.
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from netkit import Daemon, exchange, request  # noqa: E402


def stats(port: int) -> dict:
    status, _, body = exchange(port, request("GET", "/api/stats"), 30)
    if status != 200:
        raise RuntimeError(f"/api/stats answered {status}")
    return json.loads(body)


class SseListener:
    """What the dashboard asks of the daemon: the event stream, read to the end of every event, and a stats poll."""

    def __init__(self, port: int, poll_s: float = 1.0) -> None:
        self.port = port
        self.events = 0
        self.bytes = 0
        self._stop = threading.Event()
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=5)
        self.sock.sendall(b"GET /api/events HTTP/1.1\r\nHost: 127.0.0.1\r\nAccept: text/event-stream\r\n\r\n")
        self.sock.settimeout(0.5)
        self._threads = [threading.Thread(target=self._read, daemon=True),
                         threading.Thread(target=self._poll, args=(poll_s,), daemon=True)]
        for thread in self._threads:
            thread.start()

    def _read(self) -> None:
        tail = b""
        while not self._stop.is_set():
            try:
                chunk = self.sock.recv(1 << 16)
            except TimeoutError:
                continue
            except OSError:
                return
            if not chunk:
                return
            self.bytes += len(chunk)
            data = tail + chunk
            self.events += data.count(b"\ndata: ") + data.startswith(b"data: ")
            tail = data[-8:]  # a "data:" split across two reads is counted once

    def _poll(self, every: float) -> None:
        while not self._stop.wait(every):
            try:
                stats(self.port)
            except (OSError, RuntimeError):
                pass

    def close(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=5)
        self.sock.close()


TOP = """
import sys
from basal_local.tui.app import DashboardApp
from basal_local.tui.client import DaemonClient
DashboardApp(DaemonClient(sys.argv[1])).run(headless=True)
"""


class TopListener:
    """`basal-local top`, headless, in its own process (it reads the same stream and polls the same stats)."""

    def __init__(self, port: int) -> None:
        self.proc = subprocess.Popen([sys.executable, "-c", TOP, f"http://127.0.0.1:{port}"],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.events = None
        deadline = time.time() + 60
        while stats(port).get("subscribers", 0) < 1:  # attached: its stream is open
            if self.proc.poll() is not None or time.time() > deadline:
                raise RuntimeError("the headless dashboard did not attach")
            time.sleep(0.1)

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def bench(url: str, clients: int, requests: int) -> dict:
    out = subprocess.run([sys.executable, "-m", "basal_local.cli", "bench", "--http", url, "--clients", str(clients),
                          "--requests", str(requests), "--json"], capture_output=True, text=True, timeout=1800)
    text = out.stdout.strip()
    try:
        result = json.loads(text[text.index("{"):])
    except ValueError:
        raise RuntimeError(f"bench failed (exit {out.returncode}): {out.stderr[-2000:]}") from None
    if "req_per_s" not in result:
        raise RuntimeError(f"bench failed: {result}")
    return result


def run_one(daemon: Daemon, url: str, args: argparse.Namespace, listen: bool) -> dict:
    stats(daemon.port)  # builds the trees of the batches it shows (before the run): not this run's
    before = stats(daemon.port)
    listener = None
    if listen:
        listener = TopListener(daemon.port) if args.listener == "top" else SseListener(daemon.port)
        time.sleep(0.5)  # the replay of the history is read before the clock starts
        start_events = listener.events
    try:
        result = bench(url, args.clients, args.requests)
    finally:
        if listener is not None:
            listener.close()
    after = stats(daemon.port)
    return {"listener": args.listener if listen else "none", "req_per_s": result["req_per_s"],
            "p50_ms": result["latency_ms"]["p50"], "p99_ms": result["latency_ms"]["p99"],
            "mean_batch": result["mean_batch_requests"], "errors": result["errors"],
            "events_read": (listener.events - start_events) if listener is not None and listener.events is not None
            else None,
            "batches": after["counters"]["batches"] - before["counters"]["batches"],
            "trees_built": after["trees_built"] - before["trees_built"]}


def tree_cost(repeats: int = 30) -> str:
    """In process, no daemon: one batch of 16 single-question sample requests of the demo model: what packing,
    the trie walk, the tree and its JSON cost (best of `repeats`)."""
    from basal_local.api.systemone import validate_systemone
    from basal_local.bench import single_question_requests
    from basal_local.engine.packer import pack_prompts
    from basal_local.engine.plan import plan_request
    from basal_local.engine.pretty import batch_tree
    from basal_local.model import load_model_dir
    from basal_local.model.registry import demo_model_dir

    model = load_model_dir(demo_model_dir())
    tokenizer = model.tokenizer
    prefixes = {lang: tokenizer.template_prefix(lang) for lang in ("pl", "en")}
    specs, owners = [], []
    for j, body in enumerate(single_question_requests(model.name)[:16]):
        plan = plan_request(validate_systemone(body, model.name), tokenizer, model.config.max_position_embeddings,
                            prefixes)
        for qp in plan.questions:
            owners += [(f"r{j}", qp.question.qid, o, "") for o in range(len(qp.token_ids))]
        specs += plan.prompt_specs()

    def best(work) -> float:
        times = []
        for _ in range(repeats):
            t = time.perf_counter()
            work()
            times.append(time.perf_counter() - t)
        return min(times) * 1000.0

    pack = pack_prompts(specs, prefixes)
    packing = best(lambda: pack_prompts(specs, prefixes))
    walk = best(lambda: [row.trie.blocks() for row in pack.rows])
    tree = best(lambda: batch_tree(pack.rows, owners))
    as_json = best(lambda: json.dumps(batch_tree(pack.rows, owners)))
    return (f"16 requests, {len(specs)} prompts, {pack.packed_tokens} packed tokens: pack_prompts {packing:.3f} ms, "
            f"trie walk {walk:.3f} ms, batch_tree {tree:.3f} ms, batch_tree + json.dumps {as_json:.3f} ms "
            f"(best of {repeats})")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--requests", type=int, default=1500, help="requests per bench run (default 1500)")
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--listener", choices=["sse", "top"], default="sse")
    parser.add_argument("--model", help="model directory (default: the demo model, generated once if missing)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--tree-cost", action="store_true", dest="tree_cost",
                        help="only time packing vs building a batch tree, in process, and exit")
    args = parser.parse_args()
    if args.tree_cost:
        print(tree_cost())
        return 0
    started = time.perf_counter()
    model_dir = args.model or "demo"
    daemon = Daemon((["--model", model_dir] if args.model else ["--demo"]) + ["--device", args.device])
    runs: list[dict] = []
    try:
        daemon.wait_ready()
        url = f"http://127.0.0.1:{daemon.port}"
        bench(url, args.clients, max(48, args.requests // 5))  # warm-up: planner pools, allocator, caches
        for pair in range(args.pairs):
            order = [False, True] if pair % 2 == 0 else [True, False]
            for listen in order:
                run = run_one(daemon, url, args, listen)
                run["pair"] = pair
                runs.append(run)
                if not args.json:
                    print(f"pair {pair} {'B with ' + run['listener'] if listen else 'A without':<14} "
                          f"{run['req_per_s']:8.1f} req/s  p50 {run['p50_ms']:7.1f} ms  p99 {run['p99_ms']:7.1f} ms  "
                          f"batch {run['mean_batch']:5.2f}  errors {run['errors']}  batches {run['batches']}  "
                          f"trees built {run['trees_built']}  events read {run['events_read']}", flush=True)
    finally:
        daemon.stop()
    a = [r for r in runs if r["listener"] == "none"]
    b = [r for r in runs if r["listener"] != "none"]

    def med(rows: list[dict], key: str) -> float:
        return statistics.median(r[key] for r in rows)

    summary = {"model": model_dir, "device": args.device, "clients": args.clients, "requests": args.requests,
               "pairs": args.pairs, "listener": args.listener,
               "median_req_per_s": {"without": med(a, "req_per_s"), "with": med(b, "req_per_s")},
               "median_p99_ms": {"without": med(a, "p99_ms"), "with": med(b, "p99_ms")},
               "ratio_req_per_s": round(med(b, "req_per_s") / med(a, "req_per_s"), 3),
               "ratio_p99": round(med(b, "p99_ms") / med(a, "p99_ms"), 3),
               "pair_ratios_req_per_s": [round(next(r["req_per_s"] for r in b if r["pair"] == p)
                                               / next(r["req_per_s"] for r in a if r["pair"] == p), 3)
                                         for p in range(args.pairs)],
               "seconds": round(time.perf_counter() - started, 1), "runs": runs}
    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        print(f"median without: {summary['median_req_per_s']['without']:.1f} req/s, p99 "
              f"{summary['median_p99_ms']['without']:.1f} ms; with {args.listener}: "
              f"{summary['median_req_per_s']['with']:.1f} req/s, p99 {summary['median_p99_ms']['with']:.1f} ms")
        print(f"ratio with/without: req/s {summary['ratio_req_per_s']:.3f}, p99 {summary['ratio_p99']:.3f}; "
              f"per pair req/s {summary['pair_ratios_req_per_s']}")
        print(f"took {summary['seconds']:.0f} s")
    return 1 if any(r["errors"] for r in runs) else 0


if __name__ == "__main__":
    sys.exit(main())

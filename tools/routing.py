"""What cache-aware routing between replicas buys: the mixed document stream of `basal-local bench --http URL
--documents N` against one replica, then two (in one process, then in worker processes), each routed as shipped
(to the replica whose state cache likely holds the request's document, unless its queue is much longer) and, for
the side by side, by the least queued work alone (the routing patched in this process: a measurement, not an
option of the daemon).

    python tools/routing.py MODEL_DIR [--device cpu|cuda] [--prefix-cache SIZE] [--documents 20] [--doc-chars 12000] [--json OUT]

Each daemon runs in this process (uvicorn in a thread, the daemon's own app and loading), one after another.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import socket
import sys
from pathlib import Path


@contextlib.contextmanager
def _daemon(model: str, **settings):
    from basal_local.server.daemon import InThread
    from basal_local.settings import Settings

    with socket.socket() as s:  # a free port
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    daemon = InThread(Settings.load({**settings, "port": port}, config_file=Path("/nonexistent")), [Path(model)])
    try:
        daemon.wait_ready(600)
    except RuntimeError as exc:  # it stopped itself
        raise SystemExit(str(exc)) from None
    try:
        yield daemon.url
    finally:
        daemon.stop()


@contextlib.contextmanager
def _least_queued():
    """Both replica sets routing by queued work alone, as before cache-aware routing."""
    from basal_local.replicas.front import ProcessReplicaSet
    from basal_local.replicas.inprocess import ReplicaSet

    def pick(self, pending):  # the least queued worker, charged the whole request
        return min(self.live(), key=lambda r: (r.queued, r.replica), default=None), pending.tokens

    route, shipped = ReplicaSet._route, ProcessReplicaSet._pick
    ReplicaSet._route = lambda self, plan: (self._pick(), plan.prompt_specs(), None)
    ProcessReplicaSet._pick = pick
    try:
        yield
    finally:
        ReplicaSet._route, ProcessReplicaSet._pick = route, shipped


def main() -> int:
    from basal_local.commands.benchcache import bench_http_documents

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model")
    p.add_argument("--device", default="cpu")
    p.add_argument("--prefix-cache", default="256MB", help="per replica (default 256MB; auto on a GPU)")
    p.add_argument("--documents", type=int, default=20)
    p.add_argument("--per-document", type=int, default=10)
    p.add_argument("--clients", type=int, default=32)
    p.add_argument("--doc-chars", type=int, default=12000, help="characters per document (12000: ~3.2k tokens)")
    p.add_argument("--json", help="write the results here too")
    a = p.parse_args()
    runs = [("1 replica", {}, False),
            ("2 replicas, one process", {"replicas": 2, "replica_processes": False}, False),
            ("2 replicas, one process, least queued", {"replicas": 2, "replica_processes": False}, True),
            ("2 worker processes", {"replicas": 2, "replica_processes": True}, False),
            ("2 worker processes, least queued", {"replicas": 2, "replica_processes": True}, True)]
    results = {}
    for label, settings, naive in runs:
        print(f"{label} ...", file=sys.stderr, flush=True)
        with _least_queued() if naive else contextlib.nullcontext(), \
                _daemon(a.model, device=a.device, prefix_cache=a.prefix_cache, **settings) as url:
            out = bench_http_documents(url, a.clients, a.documents, a.per_document, a.doc_chars)
        results[label] = {k: out.get(k) for k in ("req_per_s", "latency_ms", "hit_rate", "document_hits", "errors")}
        r = results[label]
        print(f"  {r['req_per_s']} req/s, p50 {r['latency_ms']['p50']} p99 {r['latency_ms']['p99']} ms, "
              f"hit rate {r['hit_rate']}, errors {r['errors']}", file=sys.stderr, flush=True)
    text = json.dumps(results, indent=1)
    print(text)
    if a.json:
        Path(a.json).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

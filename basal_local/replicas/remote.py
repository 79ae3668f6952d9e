"""The front's handle on one worker process (`RemoteReplica`): the process, its end of the duplex pipe (the messages
of wire.py), the reader thread that hands each message to the front (`front.ProcessReplicaSet`, through the `Owner`
protocol) and tells it when the pipe closed, and the worker's share of the front's books: the requests it has not
answered (`Pending`), their packed tokens (the routing cost), the documents recently sent to it, its batch ids.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Protocol

from ..engine.fills import REMEMBERED_DOCUMENTS
from . import wire
from .worker import WorkerSpec, worker_main

log = logging.getLogger("basal_local.replicas.front")  # the front's log, as restarts.py's lines



@dataclass
class Pending:
    """A request the front sent to a worker and has not had answered (it moves to another worker if this one dies)."""

    token: int
    message: wire.Submit
    future: Future
    is_cancelled: Callable[[], bool]
    tokens: int  # packed tokens: the routing cost
    arrival: float
    cancel_sent: bool = False
    deaths: int = 0  # workers that died holding this request
    shared: list[int] | None = None  # the request's shared prefix (a document), for cache-aware routing
    template: int = 0  # the template tokens `shared` starts with (cached on every worker: not in `tokens`)
    charged: int = 0  # what its worker's queue was charged: its tokens less its document where that worker has it

    def gone(self) -> bool:
        if self.future.done():
            return True
        try:
            return bool(self.is_cancelled())
        except Exception:  # a broken flag must not stop the scan; the request just runs
            return False


class Owner(Protocol):
    """Who a worker's reader thread reports to: each message, and the end of the pipe."""

    def handle(self, r: RemoteReplica, message: Any) -> None: ...

    def lost(self, r: RemoteReplica) -> None: ...


class RemoteReplica:
    """The front's handle on one worker process: its pipe, the requests it has not answered, its batch ids."""

    def __init__(self, owner: Owner, spec: WorkerSpec, context) -> None:
        self.owner = owner
        self.spec = spec
        self.replica = spec.replica
        self.device = spec.device
        self.conn, child = context.Pipe(duplex=True)
        self.process = context.Process(target=worker_main, args=(child, spec), name=f"basal-replica-{spec.replica}",
                                       daemon=False)
        self.process.start()
        child.close()  # else the front would hold the worker's end open and never see it die
        self.send_lock = threading.Lock()
        self.pending: dict[int, Pending] = {}
        self.queued = 0  # what the requests sent and not answered cost here (their `charged`): the routing cost
        # the documents recently sent to this worker (its state cache likely holds them): cache-aware routing
        self.documents: deque[list[int]] = deque(maxlen=REMEMBERED_DOCUMENTS)
        self.alive = False
        self.batches = 0
        self.running_ids: set[str] = set()
        self.batch_ids: OrderedDict[int, int] = OrderedDict()  # the worker's batch id -> the daemon's
        self.last_memory: dict[str, int] = {}
        self.last_cache: dict[str, Any] = {}  # the worker's state cache as of its last batch (describe)
        self.info: wire.Ready | None = None
        self.ready = threading.Event()
        self.load_error: str | None = None
        self.started = time.monotonic()
        self.ready_at: float | None = None
        self.lost_seen = False  # `lost` ran for this process (its pipe closed)
        self.reader = threading.Thread(target=self._read, name=f"basal-replica-{spec.replica}-reader", daemon=True)
        self.reader.start()

    def memory(self) -> dict[str, int]:
        """The worker's device memory as of its last batch."""
        return {k: v for k, v in self.last_memory.items() if not k.startswith("host_")}

    def send(self, message: Any) -> bool:
        try:
            data = wire.ENCODER.encode(message)
            with self.send_lock:
                self.conn.send_bytes(data)
            return True
        except (OSError, ValueError):
            return False

    def waiting(self) -> list[Pending]:
        """The requests sent and not in the worker's running batch."""
        running = self.running_ids
        return [p for p in list(self.pending.values()) if p.message.request_id not in running]

    def _read(self) -> None:
        try:
            while True:
                for message in wire.TO_FRONT.decode(self.conn.recv_bytes()):
                    self.owner.handle(self, message)
        except (EOFError, OSError):
            pass
        except Exception:  # a bug here must still take the worker out and requeue its work
            log.exception("reading from replica %d failed", self.replica)
        self.owner.lost(self)
        self.ready.set()

"""Engine replicas in worker processes behind one daemon (`serve --devices ... --replica-processes`).

In-process replicas share one Python process, so their lane threads and all HTTP handling share one GIL; on two
H200s that left each GPU ~20 % idle. Here the front (this module, in the daemon's process) keeps HTTP,
validation, planning and routing, and each worker process (worker.py) owns one device and runs each request to
its Outcome. One duplex pipe per worker, the messages of wire.py, read by the worker's handle (remote.py). A request goes to the worker where it costs
least: its queued tokens plus the request's, less the request's document where that worker was sent it recently
(its state cache likely holds it: cache-aware routing without asking the workers).

A worker whose pipe ends (its process died: killed, a segfault, the OOM killer) leaves the rotation; every request
it had not answered is sent once to the live worker with the least queued tokens (a decision is a pure function of
its body, so a retry cannot double an effect). A request whose second worker dies too, or that has no live worker
to go to, fails with EngineUnavailable (the dialect's 503 + Retry-After): a request that kills workers cannot take
every replica down in turn, and none waits for a process that is not there. The dead worker is started again
after a back-off (1 s, doubling per death that came soon after its load, at most 60 s); until it has loaded it is
out of rotation and `describe` (so /health, /api/ps, /api/stats) says `restarting` or `loading`.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
import weakref
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from ..engine.engine import EngineSettings
from ..engine.fills import document_overlap, shared_prefix
from ..engine.plan import RequestPlan, plan_request
from ..engine.prefix_cache import FILL_MIN_TOKENS, HIT_MIN_TOKENS
from ..engine.protocol import EngineUnavailable
from ..engine.scheduler import EngineStopped
from ..model.directory import ModelDir
from ..protocol.outcome import Outcome
from ..protocol.questions import DecisionRequest
from ..telemetry import Telemetry
from . import wire
from .relay import answered_here, fail, relay, resolve
from .remote import Pending, RemoteReplica
from .restarts import Restarts
from .start import end_forkserver, start_context
from .worker import WorkerSpec

log = logging.getLogger(__name__)

CANCEL_SCAN_S = 0.1  # how often the front looks for requests whose client went away
TREE_WAIT_S = 5.0  # a dashboard's batch tree asked of a worker: how long to wait before it reads as null
MAX_DEATHS = 2  # a request on this many workers that died fails (503) instead of going to a third

# every replica set of this process: the forkserver is ended only when all of them have stopped (a worker's exit
# status comes through the forkserver, so the others' workers would look dead without it)
_SETS: weakref.WeakSet = weakref.WeakSet()
# set by a second Ctrl-C/SIGTERM while the daemon stops (server/daemon.py): a worker still not done is killed now
HURRY = threading.Event()


@dataclass(eq=False)
class ProcessReplicaSet:
    """The Engine protocol over worker processes, one model."""

    model: ModelDir
    specs: list[WorkerSpec]
    telemetry: Telemetry
    settings: EngineSettings
    prefixes: dict[str, list[int]] = field(default_factory=dict)
    dead: set[int] = field(default_factory=set)
    stopping: bool = False

    def __post_init__(self) -> None:
        if not self.specs:
            raise ValueError("a replica set needs at least one replica")
        self._slots = {spec.replica: i for i, spec in enumerate(self.specs)}
        self.restarts = Restarts(list(self._slots), self._spawn, self.model.name)
        if self.settings.prefix_cache != "off":
            for lang in ("pl", "en"):
                self.prefixes[lang] = self.model.tokenizer.template_prefix(lang)
        _SETS.add(self)
        self._lock = threading.Lock()
        self._tokens = 0
        self._asks: dict[int, Future] = {}
        self.replicas = [RemoteReplica(self, spec, start_context()) for spec in self.specs]
        self._scanner = threading.Thread(target=self._scan, name=f"{self.model.name}-cancel-scan", daemon=True)

    # ---- life ---------------------------------------------------------------------------------------------
    def wait_ready(self, timeout: float | None = None) -> wire.Ready:
        """Block until every worker loaded its engine; raise the first load error (and stop the others)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        for r in self.replicas:
            if not r.ready.wait(None if deadline is None else max(0.0, deadline - time.monotonic())):
                self.stop(5.0)
                raise TimeoutError(f"replica {r.replica} did not load within {timeout:.0f} s")
        failed = [r for r in self.replicas if not r.alive]
        if failed:
            why = failed[0].load_error or f"replica {failed[0].replica}'s process exited while loading"
            self.stop(5.0)
            raise RuntimeError(why)
        self.restarts.load_s = max(r.ready_at - r.started for r in self.replicas if r.ready_at is not None)
        self.restarts.serving = True
        return self.replicas[0].info  # type: ignore[return-value]

    def start(self) -> None:
        self._scanner.start()

    def stop(self, timeout: float | None = 30.0) -> bool:
        self.restarts.stop()  # no restart spawns a worker after this
        self.stopping = True
        for r in self.replicas:
            if r.info is None and r.process.is_alive():  # still loading (a restart): nothing of it to drain
                r.process.kill()
            if r.process.is_alive():  # (a reaped worker's pid may be another process's by now)
                _resume(r.process.pid)
            # the Stop from a thread: a worker that reads nothing (hung, its pipe full) would hold this send, and
            # the stop with it, past the wait below and a second signal; its kill ends the send
            threading.Thread(target=r.send, args=(wire.Stop(),), name=f"basal-replica-{r.replica}-stop",
                             daemon=True).start()
        deadline = time.monotonic() + (30.0 if timeout is None else timeout)
        for r in self.replicas:
            while r.process.is_alive() and time.monotonic() < deadline and not HURRY.is_set():
                r.process.join(0.1)  # (a hung worker takes the whole wait unless a second signal hurries it)
            if r.process.is_alive():
                log.warning("replica %d did not stop in time; killing it", r.replica)
                r.process.kill()
                r.process.join(5.0)
            r.reader.join(max(0.1, deadline - time.monotonic()))
        self._fail_all(EngineStopped())
        if all(other.stopping for other in list(_SETS)):  # the last set stopped: no worker needs the server
            end_forkserver()
        return not any(r.process.is_alive() for r in self.replicas)

    # ---- the Engine protocol ------------------------------------------------------------------------------
    def live(self) -> list[RemoteReplica]:
        with self._lock:
            return [r for r in self.replicas if r.alive and r.replica not in self.dead]

    def plan(self, request: DecisionRequest) -> RequestPlan:
        return plan_request(request, self.model.tokenizer, self.model.config.max_position_embeddings, self.prefixes)

    def submit(self, plan: RequestPlan, is_cancelled: Callable[[], bool] = lambda: False,
               request_id: str = "") -> Future[Outcome]:
        future = answered_here(plan, self.model)
        if future.done():
            return future
        with self._lock:
            self._tokens += 1
            token = self._tokens
        message = wire.Submit(token, request_id, wire.encode_plan(plan))
        pending = Pending(token, message, future, is_cancelled, plan.packed_tokens, plan.arrival)
        if self.settings.prefix_cache != "off" and len(self.replicas) > 1:
            shared = shared_prefix(plan.prompt_specs())
            pending.shared = shared if len(shared) >= FILL_MIN_TOKENS else None
            # the template it starts with: cached everywhere, so neither in `tokens` nor saved by a worker
            pending.template = max((len(ids) for ids in self.prefixes.values() if shared[:len(ids)] == ids), default=0)
        self._dispatch(pending)
        return future

    def memory(self) -> dict[str, int]:
        return self.replicas[-1].memory()  # the last worker's, as of its last batch (a restart replaces it)

    def describe(self) -> list[dict[str, Any]]:
        now = time.perf_counter()
        out = []
        clock = time.monotonic()
        for r in list(self.replicas):
            waiting = r.waiting()
            label = "main" + (f"-r{r.replica}" if r.replica else "")
            lane = {"waiting": len(waiting), "waiting_tokens": sum(p.tokens for p in waiting),
                    "oldest_wait_ms": round(max((now - p.arrival for p in waiting), default=0.0) * 1000.0, 1)}
            alive = r.alive and r.replica not in self.dead
            entry = {"model": self.model.name, "replica": r.replica, "device": r.device, "alive": alive,
                     "state": self._state(r, alive), "restarts": self.restarts.count[r.replica], "batches": r.batches,
                     "waiting": len(waiting), "in_flight": len(r.pending), "queued_tokens": r.queued,
                     "pid": r.process.pid, "requests": len(r.pending), "lanes": {label: lane},
                     "memory": r.memory()}
            if r.last_cache:
                entry["prefix_cache"] = r.last_cache
            if not alive:
                entry["exit_code"] = self.restarts.exit_codes.get(r.replica)
                at = self.restarts.at.get(r.replica)
                if at is not None and entry["state"] == "restarting":
                    entry["restart_in_s"] = round(max(0.0, at - clock), 1)
            out.append(entry)
        return out

    def _state(self, r: RemoteReplica, alive: bool) -> str:
        """ready | loading (its process started, not yet loaded) | restarting (dead, waiting for its back-off)
        | stopped (the daemon is stopping) | down (dead for good: only while the set is not serving yet)."""
        if alive:
            return "ready"
        if self.stopping:
            return "stopped"
        if r.replica in self.restarts.at:
            return "restarting"
        if not r.lost_seen and r.info is None:
            return "loading"
        return "down"

    def _unavailable(self, why: str) -> EngineUnavailable:
        loading = [r.started for r in list(self.replicas) if not r.lost_seen and r.info is None]
        return EngineUnavailable(why, self.restarts.retry_after_s(loading))

    # ---- routing ------------------------------------------------------------------------------------------
    def _pick(self, pending: Pending) -> tuple[RemoteReplica | None, int]:
        """The live worker where the request costs least: its queued tokens plus the request's, less what its
        state cache likely holds of the request's document (the documents recently sent to it); with that cost."""
        live = self.live()
        if not live:
            return None, 0
        costs = [self._cost(r, pending) for r in live]
        best = min(range(len(live)), key=lambda i: (live[i].queued + costs[i], live[i].replica))
        return live[best], costs[best]

    @staticmethod
    def _cost(r: RemoteReplica, pending: Pending) -> int:
        """The request's tokens on worker `r`: less its document where `r` was sent it recently (its cache likely
        holds it). Its queue is charged this too: a request about a document the worker holds adds its questions'
        tokens, not the document's, or a worker holding the stream's documents would look busy and lose them."""
        if pending.shared is None:
            return pending.tokens
        saved = document_overlap(list(r.documents), pending.shared) - pending.template
        return max(0, pending.tokens - saved) if saved >= HIT_MIN_TOKENS else pending.tokens

    def _remember(self, r: RemoteReplica, shared: list[int] | None) -> None:
        if shared is None:
            return
        with self._lock:
            for doc in r.documents:
                if len(doc) == len(shared) and doc == shared:
                    r.documents.remove(doc)  # the most recent again
                    break
            r.documents.append(shared)  # the oldest falls out past REMEMBERED_DOCUMENTS

    def _dispatch(self, pending: Pending) -> None:
        while True:
            target, cost = (None, 0) if self.stopping else self._pick(pending)
            if target is None:
                fail(pending.future, EngineStopped() if self.stopping else self._unavailable(
                    f"no replica of {self.model.name} is serving: its worker processes died and are restarting"))
                return
            with self._lock:
                if not target.alive:
                    continue
                target.pending[pending.token] = pending
                pending.charged = cost
                target.queued += cost
            if target.send(pending.message):
                self._remember(target, pending.shared)
                return
            # the pipe broke: its reader will take the worker out; this request goes elsewhere now
            with self._lock:
                if target.pending.pop(pending.token, None) is None:
                    return  # the reader took it already and re-sent it
                target.queued -= pending.charged
                target.alive = False

    # ---- from the workers (reader threads) ---------------------------------------------------------------
    def _take(self, r: RemoteReplica, token: int) -> Pending | None:
        with self._lock:
            pending = r.pending.pop(token, None)
            if pending is not None:
                r.queued -= pending.charged
        return pending

    def handle(self, r: RemoteReplica, message: Any) -> None:
        if isinstance(message, wire.Answered):
            pending = self._take(r, message.token)
            if pending is not None:
                outcome = message.outcome
                outcome.batch_id = r.batch_ids.get(outcome.batch_id, 0)
                resolve(pending.future, outcome)
        elif isinstance(message, wire.Failed):
            pending = self._take(r, message.token)
            if pending is not None:
                fail(pending.future, wire.decode_error(message.error))
        elif isinstance(message, wire.Tree):
            ask = self._asks.pop(message.ask, None)
            if ask is not None:
                ask.set_result(message.tree)
        elif isinstance(message, wire.Ready):
            r.documents.clear()  # a new process: an empty state cache
            r.info, r.device = message, message.device
            r.last_memory = dict(message.memory)  # the weights show before the first batch
            r.last_cache = dict(message.cache)
            r.ready_at = time.monotonic()
            with self._lock:
                r.alive = True
                self.dead.discard(r.replica)
            r.ready.set()
            if self.restarts.count[r.replica]:
                log.warning("replica %d of %s on %s is back in rotation (restart %d, pid %d, loaded in %.1f s)",
                            r.replica, self.model.name, r.device, self.restarts.count[r.replica], message.pid,
                            r.ready_at - r.started)
        elif isinstance(message, wire.LoadError):
            r.load_error = message.text
            r.ready.set()
        else:  # the telemetry relay
            relay(self.telemetry, self.model.name, r, message, lambda local: self._ask_tree(r, local))

    def _ask_tree(self, r: RemoteReplica, local: int) -> Any:
        if threading.current_thread() is r.reader or not r.alive:
            return None  # the reader cannot wait for its own next message
        ask: Future = Future()
        with self._lock:
            self._tokens += 1
            number = self._tokens
        self._asks[number] = ask
        if not r.send(wire.AskTree(local, number)):
            self._asks.pop(number, None)
            return None
        try:
            return ask.result(TREE_WAIT_S)
        except Exception:
            self._asks.pop(number, None)
            return None

    def lost(self, r: RemoteReplica) -> None:
        """A worker's pipe closed: out of rotation; what it had not answered runs once more on another live worker
        (or fails with EngineUnavailable); the worker is started again after its back-off."""
        with self._lock:
            if r.lost_seen:  # a second report of the same process's end
                return
            r.lost_seen = True
            # announced once per process that had joined the rotation (`ready`): a failed send to it may have
            # marked it not alive already (`_dispatch`), before its reader saw the pipe close
            announce = r.info is not None
            r.alive = False
            self.dead.add(r.replica)
            orphans = list(r.pending.values())
            r.pending.clear()
            r.queued = 0
            r.running_ids = set()
        for pending in orphans:  # first, so that no request waits for the process to be reaped
            if pending.future.done():
                continue
            pending.deaths += 1
            if self.stopping:
                fail(pending.future, EngineStopped())
            elif pending.deaths >= MAX_DEATHS:
                fail(pending.future, self._unavailable(
                    f"the worker processes computing this request died {pending.deaths} times"))
            else:
                pending.cancel_sent = False
                self._dispatch(pending)
        # then reap it (a forkserver's child: its exit status arrives through the forkserver, a moment later)
        r.process.join(timeout=5)
        self.restarts.exit_codes[r.replica] = r.process.exitcode
        delay = self.restarts.schedule(r.replica, r.ready_at)
        if self.stopping:
            return
        again = "" if delay is None else f"; restarting it in {delay:.0f} s"
        if announce:
            log.error("replica %d of %s on %s is out of rotation: its process ended (exit code %s); %d requests "
                      "went to the others%s", r.replica, self.model.name, r.device, r.process.exitcode,
                      len(orphans), again)
        elif delay is not None:  # a restarted worker that did not load
            log.error("replica %d of %s on %s did not restart: %s%s", r.replica, self.model.name, r.device,
                      r.load_error or f"its process ended while loading (exit code {r.process.exitcode})", again)

    def _spawn(self, slot: int) -> None:
        """A fresh worker process for a dead replica's slot (Restarts' timer thread); it joins once loaded."""
        index = self._slots[slot]
        self.replicas[index] = RemoteReplica(self, self.specs[index], start_context())

    def _fail_all(self, exc: Exception) -> None:
        for r in self.replicas:
            with self._lock:
                orphans = list(r.pending.values())
                r.pending.clear()
                r.queued = 0
            for pending in orphans:
                fail(pending.future, exc)

    def _scan(self) -> None:
        """Tell workers about requests whose client went away (the lane drops them before computing)."""
        while not self.stopping:
            time.sleep(CANCEL_SCAN_S)
            for r in self.replicas:
                for pending in list(r.pending.values()):
                    if not pending.cancel_sent and pending.gone():
                        pending.cancel_sent = True
                        r.send(wire.Cancel(pending.token))


def _resume(pid: int | None) -> None:
    """Continue a worker that was stopped (SIGSTOP, a Ctrl-Z): stopped, it could not drain, and the stop waited
    its whole 30 s for it. A running worker ignores the signal."""
    if pid is not None and hasattr(signal, "SIGCONT"):
        try:
            os.kill(pid, signal.SIGCONT)
        except OSError:  # gone already
            pass

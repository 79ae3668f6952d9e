"""The Engine protocol over the replicas of a Ray Serve deployment (`serve --ray`, docs/SCALING.md).

The front is the daemon's own process and app (`server/rayserve.py` runs `basal-local serve` with this engine):
it validates and plans each request as without Ray, and `submit` sends the plan (`wire.Submit`, the worker
processes' message) through the deployment's handle to one replica (`rayreplica.EngineReplica`), whose engine
runs it to its Outcome. Ray's router picks the replica (the shorter queue of two), skips replicas it knows are
dead and waits for a replacement when none is left.

A replica whose process died before it answered (a RayActorError, possibly wrapped) costs the request nothing but
time: it is sent again, up to `RETRIES` more times (a decision is a pure function of its body, so a retry cannot
double an effect); when every try was lost the future fails with EngineUnavailable (the dialect's 503 +
Retry-After). A client that leaves cancels the call on the replica, whose lane then drops the request.

What the replicas tell the front comes with each reply and with a poll every `POLL_S` (a broadcast to every
replica): each replica's own `describe` entry (so /health, /api/stats, /api/ps and /metrics list the cluster's
replicas, a dead one until Ray replaced it) and the telemetry its engines emitted, replayed on the front's bus
as the process front replays its workers' (`relay.relay`). A batch's tree is asked of the replicas when a
dashboard opens it.

Ray is imported only inside functions: it is an optional extra; `handle` is anything with Ray's
`submit.remote(model, data)` (awaitable) and, optionally, `broadcast(method, ...)` (the tests pass fakes).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from ..engine.engine import EngineSettings
from ..engine.plan import RequestPlan, plan_request
from ..engine.protocol import EngineUnavailable
from ..engine.scheduler import Cancelled, EngineStopped
from ..model.directory import ModelDir
from ..protocol.outcome import Outcome
from ..protocol.questions import DecisionRequest
from ..telemetry import Telemetry
from . import wire
from .rayreplica import REPLY, REPORT, Report
from .relay import answered_here, fail, relay, resolve

log = logging.getLogger(__name__)
RETRIES = 3  # tries on other replicas after the first one died mid-request
RETRY_PAUSE_S = 0.2  # times the try's number: Ray's router needs a moment to learn of the dead replica
CANCEL_SCAN_S = 0.1  # how often a request in flight checks whether its client went away
POLL_S = 1.0  # how often the replicas are asked for their state
POLL_TIMEOUT_S = 10.0
TREE_WAIT_S = 5.0
FORGET_S = 60.0  # a replica that stopped answering the poll is listed (not alive) this long


@dataclass
class _Seen:
    """The front's view of one replica, as `relay.relay` keeps it."""

    replica: int  # the front's number for it, in order of first sight
    report: Report
    describe: dict[str, Any] = field(default_factory=dict)
    alive: bool = True
    last_seen: float = field(default_factory=time.monotonic)
    batches: int = 0
    batch_ids: OrderedDict = field(default_factory=OrderedDict)
    running_ids: set = field(default_factory=set)
    last_memory: dict = field(default_factory=dict)
    last_cache: dict = field(default_factory=dict)  # the replica's state cache as of its last relayed batch


class RayEngine:
    """The Engine protocol over a Ray Serve deployment's replicas, one model (the replicas may serve others)."""

    def __init__(self, model: ModelDir, handle: Any, telemetry: Telemetry, settings: EngineSettings,
                 poll_s: float = POLL_S) -> None:
        self.model = model
        self.handle = handle
        self.telemetry = telemetry
        self.settings = settings
        self.prefixes: dict[str, list[int]] = {}
        if settings.prefix_cache != "off":
            for lang in ("pl", "en"):
                self.prefixes[lang] = model.tokenizer.template_prefix(lang)
        self.stopping = False
        self._lock = threading.Lock()
        self._tokens = 0
        self._pending: set[Future] = set()
        self._seen: dict[str, _Seen] = {}
        self._stop = threading.Event()
        self.loop = asyncio.new_event_loop()
        self._loop_thread = threading.Thread(target=self.loop.run_forever, name=f"{model.name}-ray-calls",
                                             daemon=True)
        self._loop_thread.start()
        self._poll_s = poll_s
        self._poller = threading.Thread(target=self._poll_loop, name=f"{model.name}-ray-poll", daemon=True)
        if poll_s > 0 and hasattr(handle, "broadcast"):
            self._poller.start()

    # ---- the Engine protocol ------------------------------------------------------------------------------
    def plan(self, request: DecisionRequest) -> RequestPlan:
        return plan_request(request, self.model.tokenizer, self.model.config.max_position_embeddings, self.prefixes)

    def submit(self, plan: RequestPlan, is_cancelled: Callable[[], bool] = lambda: False,
               request_id: str = "") -> Future[Outcome]:
        future = answered_here(plan, self.model)
        if future.done():
            return future
        if self.stopping:
            future.set_exception(EngineStopped())
            return future
        with self._lock:
            self._tokens += 1
            token = self._tokens
            self._pending.add(future)
        data = wire.ENCODER.encode(wire.Submit(token, request_id, wire.encode_plan(plan)))
        asyncio.run_coroutine_threadsafe(self._run(future, data, is_cancelled), self.loop)
        return future

    def describe(self) -> list[dict[str, Any]]:
        """One entry per replica the front knows: its engine's own entry for this model (batches, queues, memory,
        the state cache), numbered by the front, with Ray's replica id and the process id."""
        out = []
        with self._lock:
            seen = sorted(self._seen.values(), key=lambda s: s.replica)
        for s in seen:
            own = dict(s.describe)
            lanes = {(f"{name}-r{s.replica}" if s.replica else name): lane
                     for name, lane in (own.get("lanes") or {}).items()}
            out.append({**own, "model": self.model.name, "replica": s.replica, "device": s.report.device,
                        "alive": s.alive, "state": "ready" if s.alive else "down", "batches": s.batches,
                        "lanes": lanes, "memory": s.last_memory or own.get("memory", {}),
                        **({"prefix_cache": s.last_cache} if s.last_cache else {}),
                        "pid": s.report.pid, "ray_replica": s.report.replica_id})
        return out

    def stop(self, timeout: float | None = 30.0) -> bool:
        """Fail the requests in flight with EngineStopped (the replicas belong to the deployment, which the
        command takes down after the server stopped)."""
        self.stopping = True
        self._stop.set()
        with self._lock:
            pending, self._pending = list(self._pending), set()
        for future in pending:
            fail(future, EngineStopped())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._loop_thread.join(5.0 if timeout is None else min(timeout, 5.0))
        return not self._loop_thread.is_alive()

    # ---- one request ---------------------------------------------------------------------------------------
    async def _run(self, future: Future, data: bytes, is_cancelled: Callable[[], bool]) -> None:
        try:
            for attempt in range(RETRIES + 1):
                try:
                    raw = await self._call(data, is_cancelled, future)
                except Cancelled:
                    fail(future, Cancelled())
                    return
                except Exception as exc:
                    actor = _dead_actor(exc)
                    if actor is None:
                        raise
                    self._lost(actor)
                    log.warning("a replica of %s died before answering (try %d of %d): %s", self.model.name,
                                attempt + 1, RETRIES + 1, type(exc).__name__)
                    await asyncio.sleep(RETRY_PAUSE_S * (attempt + 1))
                    continue
                self._answered(future, raw)
                return
            fail(future, EngineUnavailable(f"no replica of {self.model.name} could answer ({RETRIES + 1} tries: "
                                           "their processes died); retry shortly", 1))
        except BaseException as exc:
            fail(future, exc)
        finally:
            with self._lock:
                self._pending.discard(future)

    async def _call(self, data: bytes, is_cancelled: Callable[[], bool], future: Future) -> bytes:
        response = self.handle.submit.remote(self.model.name, data)
        task = asyncio.ensure_future(response)
        while True:
            done, _ = await asyncio.wait({task}, timeout=CANCEL_SCAN_S)
            if done:
                return task.result()
            if future.done() or _gone(is_cancelled):
                cancel = getattr(response, "cancel", None)
                if cancel is not None:  # Ray's cancel may wait for the replica's assignment: not on this loop
                    await asyncio.get_running_loop().run_in_executor(None, cancel)
                task.cancel()
                raise Cancelled()

    def _answered(self, future: Future, raw: bytes) -> None:
        reply = REPLY.decode(raw)
        seen = self._take_report(reply.report)
        answer = reply.answer
        if isinstance(answer, wire.Answered):
            outcome = answer.outcome
            outcome.batch_id = seen.batch_ids.get(outcome.batch_id, 0) if seen is not None else 0
            resolve(future, outcome)
        else:
            fail(future, wire.decode_error(answer.error))

    # ---- what the replicas report --------------------------------------------------------------------------
    def _take_report(self, report: Report) -> _Seen | None:
        """Record a replica's report and replay its telemetry for this model; its entry."""
        mine = report.models.get(self.model.name)
        with self._lock:
            seen = self._seen.get(report.replica_id)
            if seen is None:  # a new replica, maybe Ray's replacement of a dead one: it takes that one's number
                dead = sorted((s.replica, rid) for rid, s in self._seen.items() if not s.alive)
                if dead:
                    del self._seen[dead[0][1]]
                used = {s.replica for s in self._seen.values()}
                seen = _Seen(next(n for n in range(len(used) + 1) if n not in used), report)
                self._seen[report.replica_id] = seen
            seen.report, seen.alive, seen.last_seen = report, True, time.monotonic()
            if mine is None:
                return seen
            seen.describe = mine.describe
            for message in mine.relay:
                relay(self.telemetry, self.model.name, seen, message,
                      lambda local, rid=report.replica_id: self._ask_tree(rid, local))
        return seen

    def _lost(self, actor_id: str) -> None:
        with self._lock:
            for seen in self._seen.values():
                if actor_id and seen.report.actor_id == actor_id:
                    seen.alive = False

    def _poll_loop(self) -> None:
        while not self._stop.wait(self._poll_s):
            self.poll()

    def poll(self) -> None:
        """Ask every replica for its report: new replicas appear, replicas that no longer answer go down (and are
        forgotten after FORGET_S)."""
        try:
            results = self.handle.broadcast("report").results(timeout_s=POLL_TIMEOUT_S, return_exceptions=True)
        except Exception as exc:  # the controller is busy or gone; the next poll tries again
            log.debug("polling the replicas of %s: %s", self.model.name, exc)
            return
        answered = set()
        for raw in results:
            if isinstance(raw, BaseException):
                actor = _dead_actor(raw)
                if actor:
                    self._lost(actor)
                continue
            report = REPORT.decode(raw)
            answered.add(report.replica_id)
            self._take_report(report)
        now = time.monotonic()
        with self._lock:
            for rid, seen in list(self._seen.items()):
                if rid not in answered:
                    seen.alive = False
                    if now - seen.last_seen > FORGET_S:
                        del self._seen[rid]

    def _ask_tree(self, replica_id: str, local: int) -> Any:
        """A batch's tree from the replica that ran it (a broadcast: a handle cannot address one replica)."""
        if not hasattr(self.handle, "broadcast"):
            return None
        try:
            results = self.handle.broadcast("tree", replica_id, self.model.name, local).results(
                timeout_s=TREE_WAIT_S, return_exceptions=True)
        except Exception:
            return None
        return next((r for r in results if r is not None and not isinstance(r, BaseException)), None)

    def first_report(self, timeout: float = 60.0) -> Report | None:
        """The first replica's report (device, backend, dtype), polling until one answers."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self._lock:
                if self._seen:
                    return next(iter(self._seen.values())).report
            self.poll()
            time.sleep(0.2)
        return None

    def memory(self) -> dict[str, int]:
        """The last replica's device memory (Telemetry's memory probe)."""
        with self._lock:
            seen = list(self._seen.values())
        if not seen:
            return {}
        memory = seen[-1].last_memory or seen[-1].describe.get("memory") or {}
        return {k: v for k, v in memory.items() if not k.startswith("host_")}


def _gone(is_cancelled: Callable[[], bool]) -> bool:
    try:
        return bool(is_cancelled())
    except Exception:  # a broken flag must not stop the request
        return False


def _dead_actor(exc: BaseException) -> str | None:
    """The actor id ('' when unknown) when `exc` says a replica's actor died or became unreachable (possibly
    wrapped in a task error); None for any other failure."""
    try:
        from ray.exceptions import RayActorError  # optional extra; present whenever a Ray handle raised
    except ImportError:
        return None
    seen = 0
    while exc is not None and seen < 5:
        if isinstance(exc, RayActorError):
            return str(getattr(exc, "actor_id", "") or "")
        exc = getattr(exc, "cause", None) or exc.__cause__
        seen += 1
    return None

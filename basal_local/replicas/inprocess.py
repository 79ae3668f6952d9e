"""Several engine replicas of one model in this process, behind one name (docs/ARCHITECTURE.md "More than one
device").

Each replica is a ModelEngine on its own device with its own gate and lanes. Each round of a request goes to the
live replica where it costs least: that replica's queued work plus the tokens the round computes there, both in
packed tokens (a long document weighs what it costs, not one request; a document the replica's state cache holds
costs only its questions, so a request follows its document unless that replica's queue is longer by more). A replica whose batch fails is probed with a one-token forward: if the probe fails too, the device
is gone, the replica leaves the rotation and its failed batch and queued requests run on the others; if the
probe works, the failure was the batch's own and its requests get the error as on a single engine.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from ..engine.engine import ModelEngine
from ..engine.plan import RequestPlan
from ..engine.protocol import EngineUnavailable
from ..engine.requests import RoundResult, run_request
from ..engine.scheduler import EngineStopped, Job
from ..model.directory import ModelDir
from ..protocol.outcome import Outcome
from ..protocol.questions import DecisionRequest

log = logging.getLogger(__name__)


class ReplicaSet:
    """The Engine protocol over in-process replicas of one model."""

    def __init__(self, replicas: list[ModelEngine]) -> None:
        if not replicas:
            raise ValueError("a replica set needs at least one replica")
        self.replicas = replicas
        self.model: ModelDir = replicas[0].model
        self.dead: set[int] = set()
        self._lock = threading.Lock()
        self.helpers = ThreadPoolExecutor(2, f"{self.model.name}-set-helpers")
        for engine in replicas:
            engine.on_batch_failure = self._batch_failed

    def live(self) -> list[ModelEngine]:
        with self._lock:
            return [e for e in self.replicas if e.replica not in self.dead]

    def start(self) -> None:
        for engine in self.replicas:
            engine.start()

    def stop(self, timeout: float | None = 30.0) -> bool:
        self.helpers.shutdown(wait=False)
        return all([engine.stop(timeout) for engine in self.replicas])

    def plan(self, request: DecisionRequest) -> RequestPlan:
        # the replicas share the model directory, so the plan (tokens, cached-prefix split) is the same on each
        return self.replicas[0].plan(request)

    def _pick(self, exclude: ModelEngine | None = None) -> ModelEngine | None:
        """The live replica with the least queued work."""
        candidates = [e for e in self.live() if e is not exclude]
        return min(candidates, key=lambda e: (e.queued_tokens(), e.replica)) if candidates else None

    def _route(self, plan: RequestPlan) -> tuple[ModelEngine | None, list, int | None]:
        """The live replica where the round costs least: its queued tokens plus what the round computes there (its
        state cache may hold the request's document: cache-aware routing); with the round's prompts and that cost,
        so the replica does not size them again."""
        candidates = self.live()
        specs = plan.prompt_specs()
        if len(candidates) <= 1:
            return (candidates[0] if candidates else None), specs, None
        costs = {e.replica: e.round_cost(plan, specs) for e in candidates}
        engine = min(candidates, key=lambda e: (e.queued_tokens() + costs[e.replica], e.replica))
        return engine, specs, costs[engine.replica]

    def submit(self, plan: RequestPlan, is_cancelled: Callable[[], bool] = lambda: False,
               request_id: str = "") -> Future[Outcome]:
        return run_request(plan, self._submit_round, is_cancelled, request_id, self.helpers, self._evidence)

    def _evidence(self, plan: RequestPlan) -> None:
        live = self.live()
        (live[0] if live else self.replicas[0]).attach_evidence(plan)

    def _submit_round(self, plan: RequestPlan, is_cancelled: Callable[[], bool], request_id: str) -> Future[RoundResult]:
        engine, specs, tokens = self._route(plan)
        if engine is None:  # every device failed its probe: nothing here computes again
            future: Future[RoundResult] = Future()
            future.set_exception(EngineUnavailable(f"no replica of {self.model.name} is serving: every device "
                                                   "failed (the daemon's log says why); restart the daemon", 30))
            return future
        future = engine.submit_round(plan, is_cancelled, request_id, specs, tokens)
        if future.done() and isinstance(future.exception(), EngineStopped) and engine.replica in self.dead:
            # routed in the moment the replica died (its lanes drained before the job reached them): the round
            # goes to the live replicas instead of failing
            return self._submit_round(plan, is_cancelled, request_id)
        return future

    def memory(self) -> dict[str, int]:
        return self.replicas[-1].memory()  # the last replica's view of its device

    def describe(self) -> list[dict[str, Any]]:
        """Each replica's device, state and work."""
        dead = set(self.dead)
        return [e.describe_replica(alive=e.replica not in dead) for e in self.replicas]

    def _batch_failed(self, engine: ModelEngine, exc: Exception, jobs: list[Job]) -> bool:
        """Lane hook: True when the jobs were handed to other replicas (this one is dead)."""
        if len(self.replicas) == 1:
            return False
        try:
            engine.probe()
            return False  # the device computes: the batch itself failed, its requests get the error
        except Exception as probe_exc:
            log.error("replica %d of %s on %s is out of rotation: %s (probe: %s)", engine.replica,
                      engine.model.name, engine.backend.device, exc, probe_exc)
        with self._lock:
            self.dead.add(engine.replica)
        orphans = list(jobs)
        for lane in engine.lanes():
            orphans.extend(lane.drain())
        target = self._pick()
        if target is None:
            return False
        for job in orphans:
            if job.future.done():
                continue
            (self._pick() or target).put(job)
        return True

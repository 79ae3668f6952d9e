"""Several engine replicas of one model behind one name (docs/ARCHITECTURE.md "More than one device").

Each replica is a ModelEngine on its own device with its own gate and lanes. A request goes to the live
replica with the least queued work, counted in packed tokens (a long document weighs what it costs, not one
request). A replica whose batch fails is probed with a one-token forward: if the probe fails too, the device
is gone, the replica leaves the rotation and its failed batch and queued requests run on the others; if the
probe works, the failure was the batch's own and its requests get the error as on a single engine.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

from .engine import ModelEngine
from .plan import RequestPlan
from .scheduler import EngineStopped, Job

log = logging.getLogger(__name__)


class ReplicaSet:
    """The ModelEngine interface the server uses (plan, submit, waiting, stop), spread over replicas."""

    def __init__(self, replicas: list[ModelEngine]) -> None:
        if not replicas:
            raise ValueError("a replica set needs at least one replica")
        self.replicas = replicas
        self.dead: set[int] = set()
        self._lock = threading.Lock()
        for engine in replicas:
            engine.on_batch_failure = self._batch_failed

    @property
    def model(self):
        return self.replicas[0].model

    @property
    def telemetry(self):
        return self.replicas[0].telemetry

    @property
    def settings(self):
        return self.replicas[0].settings

    def _first_live(self) -> ModelEngine:
        live = self.live()
        return live[0] if live else self.replicas[0]

    @property
    def backend(self):
        """The first live replica's backend (every replica runs the same kind on its own device)."""
        return self._first_live().backend

    @property
    def gate(self):
        """The first live replica's gate (the evidence forward runs under it, on that backend)."""
        return self._first_live().gate

    @property
    def batches(self) -> int:
        return sum(engine.batches for engine in self.replicas)

    def live(self) -> list[ModelEngine]:
        with self._lock:
            return [e for e in self.replicas if e.replica not in self.dead]

    def start(self) -> None:
        for engine in self.replicas:
            engine.start()

    def stop(self, timeout: float | None = 30.0) -> bool:
        return all([engine.stop(timeout) for engine in self.replicas])

    def plan(self, request: Any) -> RequestPlan:
        # the replicas share the model directory, so the plan (tokens, cached-prefix split) is the same on each
        return self.replicas[0].plan(request)

    def _pick(self, exclude: ModelEngine | None = None) -> ModelEngine | None:
        candidates = [e for e in self.live() if e is not exclude]
        if not candidates:
            return None
        return min(candidates, key=lambda e: (e.queued_tokens(), e.replica))

    def submit(self, plan: RequestPlan, is_cancelled: Callable[[], bool] = lambda: False,
               request_id: str = "") -> Job:
        engine = self._pick()
        if engine is None:
            job = Job(plan, plan.packed_tokens, plan.prompt_specs(), is_cancelled=is_cancelled,
                      arrival=plan.arrival, request_id=request_id)
            job.fail(EngineStopped())
            return job
        return engine.submit(plan, is_cancelled, request_id)

    def waiting(self) -> int:
        return sum(engine.waiting() for engine in self.replicas)

    def lanes(self):
        return [lane for engine in self.replicas for lane in engine.lanes()]

    def describe(self) -> list[dict[str, Any]]:
        """Each replica's device, state and work, for /health and /api/stats."""
        dead = set(self.dead)
        return [{"model": e.model.name, "replica": e.replica, "device": e.backend.device,
                 "alive": e.replica not in dead, "batches": e.batches, "waiting": e.waiting(),
                 "queued_tokens": e.queued_tokens()} for e in self.replicas]

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

"""A lane: one queue of an engine and the thread that drains it, batch by batch (engine.py's module docstring).

The lane forms batches (scheduler.py) and hands them to its engine (`launch_batch`, `complete_batch`); with a
backend that launches without waiting it overlaps the next batch's host work with the device's (`Flight`,
`Lane._await_lead`).
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Any

from .packer import PackPlan
from .scheduler import RATE_START, Cancelled, EngineStopped, Job, form_batch

log = logging.getLogger("basal_local.engine.engine")

# a flight expected to take the device less than this is answered before the next batch forms: overlapping its
# host work would gain little, and waiting on an estimate would add latency to lone requests
PIPELINE_MIN_S = 0.015
# a job whose document a batch in flight is storing waits for that batch (Lane._hold_documents_in_flight), looking
# again every HOLD_POLL_S, for at most HOLD_MAX_S (a long document on a CPU takes tens of seconds)
HOLD_POLL_S = 0.002
HOLD_MAX_S = 30.0


@dataclass
class Flight:
    """A batch handed to the device and not yet answered."""

    jobs: list[Job]
    pack: PackPlan
    owners: list[tuple[int, int, int]]
    prompts: int
    launched: list[Any]  # per forward: done() / result() / device_s()
    batch_id: int
    started: float  # when the lane began packing it (queue and compute times are measured from here)
    prep_s: float  # host time from packing to the last launch
    device_start: float = 0.0  # when the device began it: its launch, or the end of the flight before it
    est_s: float = 0.0  # expected device time
    ended: float = 0.0  # when its logits were back
    waited: bool = False  # whether the lane had to wait for them (then `ended` is when the device finished)
    after: float = 0.0  # when the batch before it ended, if the device was still busy with that at its launch
    overlap: bool = False  # whether the next batch may form while it computes (a known, long enough device time)
    lease: Any = None  # the state cache's entries it reads and writes (prefix_cache.Lease), settled once answered
    cached: list[int] | None = None  # per job: tokens of its prompts continued from the cache

    def done(self) -> bool:
        return all(f.done() for f in self.launched)


def _size_class(tokens: int) -> int:
    """Device-time estimates are kept per 128 packed tokens (forwards are padded to buckets of 64 and more)."""
    return (max(int(tokens), 1) + 127) // 128


class Lane:
    """One queue and the thread that drains it. Nothing a single job does may stop the thread. `engine` is
    the ModelEngine that owns it (typed loosely: engine.py imports this module)."""

    def __init__(self, engine: Any, name: str, urgent: bool) -> None:
        self.engine = engine
        self.name = name
        self.urgent = urgent
        self.queue: list[Job] = []
        self.running_tokens = 0  # packed tokens of the batch in progress (routing between replicas)
        self.rate = RATE_START
        self.last_jobs = 0  # the previous batch: size, end and duration (batch coalescing in `_admit`)
        self.last_end = 0.0
        self.last_s = 0.0
        # pipelining (module docstring): device seconds per size class, host seconds to prepare a batch
        self.device_est: dict[int, float] = {}
        self.prep_est = 0.0
        self._cond = threading.Condition()
        self._stop = False
        # "main", "long"; "main-r1" ... for the other replicas of a model (telemetry keys, dashboard)
        self.label = name + (f"-r{engine.replica}" if engine.replica else "")
        self.thread = threading.Thread(target=self._loop, name=f"{engine.model.name}-{self.label}", daemon=True)

    def put(self, job: Job) -> None:
        with self._cond:
            if self._stop:
                job.fail(EngineStopped())
                return
            self.queue.append(job)
            self._cond.notify()

    def stop(self) -> None:
        """Refuse new jobs, fail the queued ones; the batch in progress finishes."""
        with self._cond:
            self._stop = True
            queued, self.queue = self.queue, []
            self._cond.notify_all()
        for job in queued:
            job.fail(EngineStopped())

    def drain(self) -> list[Job]:
        """Stop the lane and hand back its queued jobs unanswered (a dead replica's work goes elsewhere)."""
        with self._cond:
            self._stop = True
            queued, self.queue = self.queue, []
            self._cond.notify_all()
        return queued

    def waiting(self) -> int:
        with self._cond:
            return len(self.queue)

    def queued_tokens(self) -> int:
        with self._cond:
            return sum(job.tokens for job in self.queue) + self.running_tokens

    def _admit(self, block: bool = True, flight: Flight | None = None, coalesce: bool = True) -> list[Job] | None:
        """The next batch (empty if none); None where a queued job waits for a document `flight` (the batch in
        progress) is storing: the lane answers that flight first and then forms the batch, the job continuing the
        stored document, instead of forming it now and leaving the job for the batch after (a whole batch later)."""
        with self._cond:
            while block and not self.queue and not self._stop:
                self._cond.wait()
            if not self.queue:
                return []
            if block and coalesce:
                self._coalesce()
            if self._stop:
                return []
            live = []
            for job in self.queue:
                if job.gone():
                    self.engine.telemetry.count("cancelled")
                    job.fail(Cancelled())
                else:
                    live.append(job)
            ready, held = self._hold_documents_in_flight(live)
            if held and flight is not None and flight.lease is not None and flight.lease.filled:
                self.queue = live
                return None
            settings = self.engine.settings
            budget = settings.max_batch_tokens if self.urgent else 0  # the long lane runs one request at a time
            batch, rest = form_batch(ready, budget, self.engine.prefixes, settings.schedule, self.rate)
            if held:  # the queue keeps its order: the held jobs stay where they were
                taken = {id(job) for job in batch}
                rest = [job for job in live if id(job) not in taken]
            self.queue = rest
            if not batch and held and block:
                self._cond.wait(HOLD_POLL_S)  # until the batch storing their document completes
            return batch

    def _hold_documents_in_flight(self, live: list[Job]) -> tuple[list[Job], list[Job]]:
        """The jobs whose document a batch in flight is storing in the state cache wait for it (then they
        continue it as a hit instead of computing it again), for at most HOLD_MAX_S."""
        cache = self.engine.cache
        if cache is None or not live:
            return live, []
        now = time.perf_counter()
        changes = (cache.pending_changes, cache.generation)  # what an answer depends on: pending and stored entries
        keep, held = [], []
        for job in live:
            if not job.specs or now - job.arrival >= HOLD_MAX_S:
                keep.append(job)
                continue
            # asked again only once the entries changed (a long document's match is not free, and a held job is
            # looked at every HOLD_POLL_S)
            if job.in_flight is None or job.in_flight[0] != changes:
                job.in_flight = (changes, cache.in_flight(job.specs[0].token_ids))
            (held if job.in_flight[1] else keep).append(job)
        return keep, held

    def _coalesce(self) -> None:
        """Hold a small queue briefly after a big batch (EngineSettings.coalesce_ms); called with _cond held."""
        window = min(self.engine.settings.coalesce_ms / 1000.0, 0.25 * self.last_s)
        if not self.urgent or window <= 0 or self.last_jobs < 4:
            return
        deadline = self.last_end + window
        while not self._stop and len(self.queue) < self.last_jobs // 2:
            remaining = deadline - time.perf_counter()
            if remaining <= 0:
                return
            self._cond.wait(remaining)

    def _loop(self) -> None:
        flight: Flight | None = None
        held = False  # the last admission waited for the flight's documents: the batch forms now, not coalesced
        while True:
            if flight is not None:
                self._await_lead(flight)
                if flight.done() or not flight.overlap:  # answer it before taking new work
                    self._complete(flight)
                    flight = None
                    self.running_tokens = 0  # idle until the next batch (routing reads it meanwhile)
            batch: list[Job] = []
            launched: Flight | None = None
            try:
                admitted = self._admit(block=flight is None, flight=flight, coalesce=not held)
                held = admitted is None
                batch = admitted or []
                if batch:
                    self.running_tokens = sum(job.tokens for job in batch) + (flight.pack.packed_tokens
                                                                              if flight else 0)
                    launched = self.engine.launch_batch(batch, self)
                    self._expect(launched)
            except Exception as exc:
                self._failed(exc, batch)
            if flight is not None:
                self._complete(flight)
                if launched is not None and flight.waited:  # the device took the new batch when this one ended
                    launched.after = flight.ended
                    launched.device_start = max(launched.device_start, flight.ended)
            flight = launched
            if flight is None:
                self.running_tokens = 0
                if self._stop:
                    return

    def _complete(self, flight: Flight) -> None:
        try:
            self.engine.complete_batch(flight, self)
        except Exception as exc:
            self._failed(exc, flight.jobs)
        self._learn(flight)
        self.last_end = time.perf_counter()
        self.last_jobs, self.last_s = len(flight.jobs), self.last_end - flight.started

    def _failed(self, exc: Exception, batch: list[Job]) -> None:
        """Never lose the thread; every member of the batch gets the error."""
        log.error("batch failed in lane %s", self.thread.name, exc_info=exc)
        self.engine.telemetry.batch_failed(self.engine.model.name, self.label, exc)
        handler = self.engine.on_batch_failure
        if handler is None or not handler(self.engine, exc, batch):
            for job in batch:
                job.fail(exc)

    # ---- pipelining ------------------------------------------------------------------------------------------
    def _expect(self, flight: Flight) -> None:
        """How long the device will take for `flight`, and how long preparing a batch takes the host."""
        tokens = flight.pack.packed_tokens
        est = self._estimate(tokens)
        flight.est_s = est if est is not None else tokens / max(self.rate, 1.0)
        flight.overlap = self.engine.settings.pipeline and est is not None and est >= PIPELINE_MIN_S
        self.prep_est = flight.prep_s if self.prep_est == 0.0 else 0.8 * self.prep_est + 0.2 * flight.prep_s

    def _estimate(self, tokens: int) -> float | None:
        """Expected device seconds for a batch of `tokens`: its size class's, else the nearest class's scaled by
        size; None before any batch was timed."""
        if not self.device_est:
            return None
        key = _size_class(tokens)
        if key in self.device_est:
            return self.device_est[key]
        near = min(self.device_est, key=lambda k: abs(k - key))
        return self.device_est[near] * key / near

    def _learn(self, flight: Flight) -> None:
        """Learn the device time of a finished flight (where the backend measures it)."""
        times = [f.device_s() for f in flight.launched]
        if not times or any(t is None for t in times):
            return
        device_s = float(sum(times))
        key = _size_class(flight.pack.packed_tokens)
        old = self.device_est.get(key)
        self.device_est[key] = device_s if old is None else 0.7 * old + 0.3 * device_s

    def _await_lead(self, flight: Flight) -> None:
        """Wait until the device is about one batch preparation away from finishing `flight` (or has finished
        it): the next batch then takes everything that queued meanwhile and still starts on time."""
        if not flight.overlap or flight.done():
            return
        lead = max(1.2 * self.prep_est, 0.0015)
        target = flight.device_start + flight.est_s - lead
        while not self._stop:
            now = time.perf_counter()
            if now >= target or flight.done():
                return
            time.sleep(min(target - now, 0.0005))



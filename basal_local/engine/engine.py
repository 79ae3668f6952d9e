"""One engine per model: a main lane and an optional long lane, each a thread that owns its queue.

Requests arrive planned (validated, rendered, tokenized, sized). A lane drops cancelled requests, orders
the queue (HRRN or FIFO), forms a batch within `max_batch_tokens`, packs it into prefix-tree forwards and
runs them through the backend under the device gate.

Where the backend can hand a forward to its device without waiting (`launch`, the CUDA graphs), the main lane
overlaps its host work with the device's: while batch k computes, the lane answers batch k-1, and shortly
before k is expected to end it forms, packs and launches k+1 from whatever has queued by then (`_Flight`,
`Lane._await_lead`). Batch membership never changes a result (the kernels are batch-invariant), so this is
free to do.
"""

from __future__ import annotations

import gc
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from basal_local.backends.base import Backend, PackedBatch, Ready

from ..model.directory import ModelDir
from ..telemetry import BatchRecord, Telemetry
from .gate import DeviceGate
from .packer import PackPlan, pack_prompts
from .plan import RequestPlan, finish, plan_request
from .pretty import batch_tree, unit_label
from .scheduler import RATE_START, Cancelled, EngineStopped, Job, form_batch

log = logging.getLogger(__name__)


# a flight expected to take the device less than this is answered before the next batch forms: overlapping its
# host work would gain little, and waiting on an estimate would add latency to lone requests
PIPELINE_MIN_S = 0.015


def freeze_heap() -> None:
    """Take everything loaded so far (libraries, model, tokenizer) out of the garbage collector's view.

    A full collection walks every object the process holds and stalls every thread meanwhile (~50-400 ms with
    torch and a model loaded); under load it struck a few times a minute, each time holding up every request
    of a batch. After the freeze, collections see only what serving allocates."""
    gc.collect()
    gc.freeze()


@dataclass
class EngineSettings:
    max_batch_tokens: int = 8192
    schedule: str = "hrrn"  # or "fifo"
    long_tokens: int = 4096  # 0 disables the long lane
    long_slice_ms: float = 100.0
    max_row_tokens: int = 32768
    max_forward_tokens: int = 8192
    prefix_cache: bool = True
    # after a batch of n requests, wait up to this long (and at most a quarter of that batch's time) for n/2 to
    # queue before starting a small batch, so closed-loop clients do not alternate full and tiny batches.
    # Off by default: 20 ms on the H200 (32 HTTP clients) gave p99 282 vs 314 ms and -1.5 % req/s, one trial
    # each, within noise (docs/PERFORMANCE.md)
    coalesce_ms: float = 0.0
    # overlap a batch's host work (packing, inputs, answering) with the previous batch's device work where the
    # backend can launch without waiting (module docstring)
    pipeline: bool = True


@dataclass
class JobResult:
    body: dict[str, Any]
    queue_ms: float
    compute_ms: float
    batch_requests: int
    batch_id: int


@dataclass
class _Flight:
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

    def done(self) -> bool:
        return all(f.done() for f in self.launched)


def _size_class(tokens: int) -> int:
    """Device-time estimates are kept per 128 packed tokens (forwards are padded to buckets of 64 and more)."""
    return (max(int(tokens), 1) + 127) // 128


class Lane:
    """One queue and the thread that drains it. Nothing a single job does may stop the thread."""

    def __init__(self, engine: ModelEngine, name: str, urgent: bool) -> None:
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

    def _admit(self, block: bool = True) -> list[Job]:
        with self._cond:
            while block and not self.queue and not self._stop:
                self._cond.wait()
            if not self.queue:
                return []
            if block:
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
            settings = self.engine.settings
            budget = settings.max_batch_tokens if self.urgent else 0  # the long lane runs one request at a time
            batch, rest = form_batch(live, budget, self.engine.prefixes, settings.schedule, self.rate)
            self.queue = rest
            return batch

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
        flight: _Flight | None = None
        while True:
            if flight is not None:
                self._await_lead(flight)
                if flight.done() or not flight.overlap:  # answer it before taking new work
                    self._complete(flight)
                    flight = None
            batch: list[Job] = []
            launched: _Flight | None = None
            try:
                batch = self._admit(block=flight is None)
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

    def _complete(self, flight: _Flight) -> None:
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
    def _expect(self, flight: _Flight) -> None:
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

    def _learn(self, flight: _Flight) -> None:
        """Learn the device time of a finished flight (where the backend measures it)."""
        times = [f.device_s() for f in flight.launched]
        if not times or any(t is None for t in times):
            return
        device_s = float(sum(times))
        key = _size_class(flight.pack.packed_tokens)
        old = self.device_est.get(key)
        self.device_est[key] = device_s if old is None else 0.7 * old + 0.3 * device_s

    def _await_lead(self, flight: _Flight) -> None:
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


def _tree_builder(rows: list, jobs: Sequence[Job], owners: list[tuple[int, int, int]]) -> Callable[[], list]:
    """What builds the batch's tree later, holding only the tries and the owners' names (never the jobs: their
    plans and token lists would stay alive as long as the batch's record)."""
    units = [[(job.request_id, qp.question.qid, qp.role, qp.index, qp.question.keys) for qp in job.plan.questions]
             for job in jobs]

    def build() -> list:
        named = []
        for j, q, o in owners:
            rid, qid, role, index, keys = units[j][q]
            named.append((rid, qid, o, unit_label(role, index, keys)))
        return batch_tree(rows, named)

    return build


class ModelEngine:
    """One model on one device: its lanes, its backend, the device's gate. `replica` numbers the copies of a
    model on several devices (engine/replicas.py)."""

    def __init__(self, model: ModelDir, backend: Backend, gate: DeviceGate, telemetry: Telemetry,
                 settings: EngineSettings | None = None, replica: int = 0) -> None:
        self.model = model
        self.backend = backend
        self.gate = gate
        self.telemetry = telemetry
        self.settings = settings or EngineSettings()
        self.replica = replica
        self.batches = 0
        # called by a lane whose batch raised, before its jobs fail; True = the jobs were handed elsewhere
        self.on_batch_failure: Callable[[ModelEngine, Exception, list[Job]], bool] | None = None
        self.prefixes: dict[str, list[int]] = {}
        if self.settings.prefix_cache:
            for lang in ("pl", "en"):
                ids = model.tokenizer.template_prefix(lang)
                backend.add_prefix(lang, ids)
                self.prefixes[lang] = ids
        warmup = getattr(backend, "warmup", None)
        if warmup is not None:  # e.g. capture CUDA graphs before the first request
            warmup(self.settings.max_forward_tokens)
        self.main = Lane(self, "main", urgent=True)
        self.long = Lane(self, "long", urgent=False) if self.settings.long_tokens > 0 else None

    def lanes(self) -> list[Lane]:
        return [self.main] + ([self.long] if self.long else [])

    def start(self) -> None:
        for lane in self.lanes():
            lane.thread.start()

    def stop(self, timeout: float | None = 30.0) -> bool:
        """Stop every lane: queued jobs fail with EngineStopped, running batches finish, threads are joined.

        Returns whether every lane thread ended within `timeout` seconds."""
        for lane in self.lanes():
            lane.stop()
        deadline = None if timeout is None else time.monotonic() + timeout
        for lane in self.lanes():
            if lane.thread.is_alive():
                lane.thread.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
        return not any(lane.thread.is_alive() for lane in self.lanes())

    def plan(self, request: Any) -> RequestPlan:
        return plan_request(request, self.model.tokenizer, self.model.config.max_position_embeddings,
                            self.prefixes)

    def submit(self, plan: RequestPlan, is_cancelled: Callable[[], bool] = lambda: False,
               request_id: str = "") -> Job:
        job = Job(plan, plan.packed_tokens, plan.prompt_specs(), is_cancelled=is_cancelled, arrival=plan.arrival,
                  request_id=request_id, background=plan.background)
        if not plan.questions:  # every question fixed: nothing to compute
            body = finish(plan, [], self.model.calibration, 0.0)
            job.resolve(JobResult(body, 0.0, 0.0, 1, 0))
            return job
        self.put(job)
        return job

    def waiting(self) -> int:
        return sum(lane.waiting() for lane in self.lanes())

    def queued_tokens(self) -> int:
        """Packed tokens waiting or computing in every lane: the routing cost between replicas."""
        return sum(lane.queued_tokens() for lane in self.lanes())

    def put(self, job: Job) -> None:
        """Queue a job in the lane its size calls for."""
        long_lane = self.long is not None and job.tokens > self.settings.long_tokens
        self.telemetry.emit("queued", id=job.request_id, model=self.model.name, lane="long" if long_lane else "main")
        (self.long if long_lane else self.main).put(job)

    def probe(self) -> None:
        """One tiny forward under the gate; raises when the device no longer computes."""
        first = self.model.tokenizer.letter_ids[0]
        batch = PackedBatch(token_ids=np.array([first], dtype=np.int64), positions=np.zeros(1, dtype=np.int64),
                            token_block=np.zeros(1, dtype=np.int32), block_parent=np.array([-1], dtype=np.int32),
                            block_prefix=np.array([-1], dtype=np.int32), readout_index=np.zeros(1, dtype=np.int64),
                            letter_ids=np.array([first], dtype=np.int64))
        self.gate.acquire(urgent=True)
        try:
            self.backend.forward(batch)
        finally:
            self.gate.release()

    def _forward(self, batch, lane: Lane) -> np.ndarray:
        if lane.urgent:
            self.gate.acquire(urgent=True)
            try:
                return self.backend.forward(batch)
            finally:
                self.gate.release()
        self.gate.acquire(urgent=False)
        try:
            for step in self.backend.forward_steps(batch):
                if step is None:
                    self.gate.checkpoint()
                else:
                    return step
        finally:
            self.gate.release()
        raise RuntimeError("forward_steps ended without logits")

    def _launch(self, batch, lane: Lane) -> Any:
        """Hand one forward to the backend: without waiting for the device where the backend can (`launch`)
        and the lane pipelines; the long lane's preemptible steps always wait."""
        if lane.urgent:
            launch = getattr(self.backend, "launch", None) if self.settings.pipeline else None
            self.gate.acquire(urgent=True)
            try:
                return launch(batch) if launch is not None else Ready(self.backend.forward(batch))
            finally:
                self.gate.release()
        return Ready(self._forward(batch, lane))

    def run_batch(self, jobs: Sequence[Job], lane: Lane) -> None:
        """Pack, compute and answer one batch, waiting for it."""
        self.complete_batch(self.launch_batch(jobs, lane), lane)

    def launch_batch(self, jobs: Sequence[Job], lane: Lane) -> _Flight:
        """Pack a batch and hand its forwards to the device; `complete_batch` answers it."""
        started = time.perf_counter()
        specs = []
        owners: list[tuple[int, int, int]] = []
        for j, job in enumerate(jobs):
            for q, qp in enumerate(job.plan.questions):
                for o in range(len(qp.token_ids)):
                    owners.append((j, q, o))
            specs.extend(job.specs)
        s = self.settings
        pack = pack_prompts(specs, self.prefixes, s.max_row_tokens, s.max_forward_tokens)
        batch_id = self.telemetry.next_batch_id()
        self.telemetry.batch_started(batch_id, self.model.name, lane.label, [j.request_id for j in jobs],
                                     pack.packed_tokens)
        launched = [self._launch(b, lane) for b in pack.batches]
        now = time.perf_counter()
        return _Flight(list(jobs), pack, owners, len(specs), launched, batch_id, started, now - started,
                       device_start=now)

    def complete_batch(self, flight: _Flight, lane: Lane) -> None:
        """Wait for a launched batch's logits and answer its jobs."""
        jobs, pack, started, batch_id = flight.jobs, flight.pack, flight.started, flight.batch_id
        flight.waited = not flight.done()
        outputs = [f.result() for f in flight.launched]
        flight.ended = time.perf_counter()
        logits: list[list[list[np.ndarray]]] = [[[None] * len(qp.token_ids) for qp in job.plan.questions]
                                                for job in jobs]  # type: ignore[misc]
        for (j, q, o), (b, r, cols) in zip(flight.owners, pack.readouts):
            logits[j][q][o] = outputs[b][r, cols]
        # its own compute: from packing (or, launched behind another batch, from that one's end) to the logits
        elapsed = time.perf_counter() - max(started, flight.after)
        if elapsed > 0.001:
            lane.rate = 0.8 * lane.rate + 0.2 * pack.packed_tokens / elapsed
        self.batches += 1
        compute_ms = elapsed * 1000.0
        # the batch is on record before any of its answers leaves, so /api/stats always knows it
        self.telemetry.record_batch(BatchRecord(
            batch_id, self.model.name, lane.label, len(jobs), sum(len(j.plan.questions) for j in jobs), flight.prompts,
            len(pack.batches), pack.packed_tokens, pack.unpacked_tokens, round(compute_ms, 3), time.time(),
            tree=self.telemetry.lazy_tree(_tree_builder(pack.rows, jobs, flight.owners)),
            request_ids=[j.request_id for j in jobs], replica=self.replica, device=self.backend.device))
        for j, job in enumerate(jobs):
            try:
                body = finish(job.plan, logits[j], self.model.calibration,
                              (time.perf_counter() - job.plan.arrival) * 1000.0)
            except Exception as exc:  # one request's answer failing must not take its batch-mates' answers
                log.exception("answer of request %s failed", job.request_id)
                job.fail(exc)
                continue
            queue_ms = (started - job.arrival) * 1000.0
            job.resolve(JobResult(body, queue_ms, compute_ms, len(jobs), batch_id))

"""One engine per model: a main lane and an optional long lane, each a thread that owns its queue.

Requests arrive planned (validated, rendered, tokenized, sized). A lane drops cancelled requests, orders
the queue (HRRN or FIFO), forms a batch within `max_batch_tokens`, packs it into prefix-tree forwards and
runs them through the backend under the device gate.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from basal_local.backends.base import Backend, PackedBatch

from ..model.directory import ModelDir
from ..telemetry import BatchRecord, Telemetry
from .gate import DeviceGate
from .packer import pack_prompts
from .plan import RequestPlan, finish, plan_request
from .pretty import batch_tree, unit_label
from .scheduler import RATE_START, Cancelled, EngineStopped, Job, form_batch

log = logging.getLogger(__name__)


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


@dataclass
class JobResult:
    body: dict[str, Any]
    queue_ms: float
    compute_ms: float
    batch_requests: int
    batch_id: int


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

    def _admit(self) -> list[Job]:
        with self._cond:
            while not self.queue and not self._stop:
                self._cond.wait()
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
        while True:
            batch: list[Job] = []
            try:
                batch = self._admit()
                if not batch:
                    if self._stop:
                        return
                    continue
                self.running_tokens = sum(job.tokens for job in batch)
                started = time.perf_counter()
                self.engine.run_batch(batch, self)
                self.last_end = time.perf_counter()
                self.last_jobs, self.last_s = len(batch), self.last_end - started
            except Exception as exc:  # never lose the thread; every member of the batch gets the error
                log.exception("batch failed in lane %s", self.thread.name)
                self.engine.telemetry.batch_failed(self.engine.model.name, self.label, exc)
                handler = self.engine.on_batch_failure
                if handler is None or not handler(self.engine, exc, batch):
                    for job in batch:
                        job.fail(exc)
            finally:
                self.running_tokens = 0


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
                  request_id=request_id)
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

    def run_batch(self, jobs: Sequence[Job], lane: Lane) -> None:
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
        outputs = [self._forward(b, lane) for b in pack.batches]
        logits: list[list[list[np.ndarray]]] = [[[None] * len(qp.token_ids) for qp in job.plan.questions]
                                                for job in jobs]  # type: ignore[misc]
        for (j, q, o), (b, r, cols) in zip(owners, pack.readouts):
            logits[j][q][o] = outputs[b][r, cols]
        elapsed = time.perf_counter() - started
        if elapsed > 0.001:
            lane.rate = 0.8 * lane.rate + 0.2 * pack.packed_tokens / elapsed
        self.batches += 1
        compute_ms = elapsed * 1000.0
        # the batch is on record before any of its answers leaves, so /api/stats always knows it
        self.telemetry.record_batch(BatchRecord(
            batch_id, self.model.name, lane.label, len(jobs), sum(len(j.plan.questions) for j in jobs), len(specs),
            len(pack.batches), pack.packed_tokens, pack.unpacked_tokens, round(compute_ms, 3), time.time(),
            tree=self.telemetry.lazy_tree(_tree_builder(pack.rows, jobs, owners)),
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

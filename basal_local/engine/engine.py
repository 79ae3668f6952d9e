"""One engine per model: a main lane and an optional long lane, each a thread that owns its queue.

Requests arrive planned (validated, rendered, tokenized, sized). A lane drops cancelled requests, orders
the queue (HRRN or FIFO), forms a batch within `max_batch_tokens`, packs it into prefix-tree forwards and
runs them through the backend under the device gate.

Where the backend can hand a forward to its device without waiting (`launch`, the CUDA graphs), the main lane
overlaps its host work with the device's: while batch k computes, the lane answers batch k-1, and shortly
before k is expected to end it forms, packs and launches k+1 from whatever has queued by then (`Flight`,
`Lane._await_lead`). Batch membership never changes a result (the kernels are batch-invariant), so this is
free to do.
"""

from __future__ import annotations

import gc
import logging
import time
import weakref
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np

from basal_local.backends.base import Backend, PackedBatch, Ready
from basal_local.backends.memory import budget_bytes

from ..model.directory import ModelDir
from ..protocol.outcome import Outcome
from ..protocol.questions import DecisionRequest
from ..settings import EngineSettings
from ..telemetry import BatchRecord, Telemetry
from .evidence import attach_evidence
from .fills import plan_fills
from .gate import DeviceGate
from .lane import Flight, Lane
from .packer import pack_prompts
from .plan import RequestPlan, finish, packed_size, plan_request
from .prefix_cache import PrefixCache
from .pretty import batch_tree, unit_label
from .requests import RoundResult, run_request
from .scheduler import Job

log = logging.getLogger(__name__)


def freeze_heap() -> None:
    """Take everything loaded so far (libraries, model, tokenizer) out of the garbage collector's view.

    A full collection walks every object the process holds and stalls every thread meanwhile (~50-400 ms with
    torch and a model loaded); under load it struck a few times a minute, each time holding up every request
    of a batch. After the freeze, collections see only what serving allocates."""
    gc.collect()
    gc.freeze()


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
    model on several devices (replicas/inprocess.py)."""

    def __init__(self, model: ModelDir, backend: Backend, gate: DeviceGate, telemetry: Telemetry,
                 settings: EngineSettings | None = None, replica: int = 0, device_replicas: int = 1) -> None:
        self.model = model
        self.backend = backend
        self.gate = gate
        self.telemetry = telemetry
        self.settings = settings or EngineSettings()
        self.replica = replica
        self.device_replicas = device_replicas  # replicas of this model on this device: they share its memory
        self.batches = 0
        # called by a lane whose batch raised, before its jobs fail; True = the jobs were handed elsewhere
        self.on_batch_failure: Callable[[ModelEngine, Exception, list[Job]], bool] | None = None
        try:  # the first forwards (the templates, the warm-up): where damaged weights show first
            self.cache, self.prefixes = self._open_cache(model, backend)
            warmup = getattr(backend, "warmup", None)
            if warmup is not None:  # e.g. capture CUDA graphs before the first request
                warmup(self.settings.max_forward_tokens)
        except FloatingPointError as exc:
            raise FloatingPointError(f"{model.name}: its first forward gave a {exc} (NaN or infinity): the "
                                     f"weights in {model.path} are damaged or were converted wrongly, or the "
                                     "dtype overflows (try --dtype bf16 or f32)") from None
        self.main = Lane(self, "main", urgent=True)
        self.long = Lane(self, "long", urgent=False) if self.settings.long_tokens > 0 else None
        # evidence forwards and the planning of later rounds (engine/requests.py), off the lanes and the caller
        self.helpers = ThreadPoolExecutor(2, f"{model.name}-helpers")

    def _open_cache(self, model: ModelDir, backend: Backend) -> tuple[PrefixCache | None, Any]:
        """The state cache (engine/prefix_cache.py) with the templates pinned in it; a backend without a pool
        (a test's fake) keeps only the templates, by language."""
        setting = self.settings.prefix_cache
        existing = getattr(backend, "state_cache", None)
        if existing is not None and existing.setting == str(setting):
            return existing, existing  # another engine on this backend (the pool is the backend's)
        if not hasattr(backend, "open_cache"):
            prefixes: dict[str, list[int]] = {}
            if setting != "off":
                for lang in ("pl", "en"):
                    prefixes[lang] = model.tokenizer.template_prefix(lang)
                    backend.add_prefix(lang, prefixes[lang])
            return None, prefixes
        per_token = backend.kv_bytes_per_token()
        templates = {lang: model.tokenizer.template_prefix(lang) for lang in ("pl", "en")}
        # replicas on one device split its memory, unless --gpu-memory already gives each its own part
        shared = self.device_replicas if getattr(backend, "memory_limit_bytes", None) is None else 1
        weights = backend.memory().get("weights_bytes", 0) if shared > 1 else 0
        capacity = budget_bytes(setting, backend.device_memory(), replicas=shared, weights=weights) // per_token
        if setting != "off":  # the templates always fit, whatever the budget
            capacity = max(capacity, sum(len(ids) for ids in templates.values()))
        cache = PrefixCache(capacity, per_token, enabled=setting != "off", setting=str(setting))
        # the backend holds its cache (its pool's bookkeeping); the cache reaches the backend only weakly, so a
        # dropped backend is freed where it is dropped, never by the garbage collector (backends/torch/forward.py)
        drop = weakref.WeakMethod(backend.drop_prefix)
        cache.on_drop = lambda name: (method := drop()) is not None and method(name)
        backend.open_cache(cache.capacity)
        backend.state_cache = cache
        for lang, ids in templates.items():
            entry = cache.pin(lang, ids)
            if entry is not None:
                backend.add_prefix(lang, ids, entry.offset)
                cache.publish(entry)
        return cache, cache

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
        self.helpers.shutdown(wait=False)
        deadline = None if timeout is None else time.monotonic() + timeout
        for lane in self.lanes():
            if lane.thread.is_alive():
                lane.thread.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
        return not any(lane.thread.is_alive() for lane in self.lanes())

    def plan(self, request: DecisionRequest) -> RequestPlan:
        return plan_request(request, self.model.tokenizer, self.model.config.max_position_embeddings,
                            self.prefixes)

    def submit(self, plan: RequestPlan, is_cancelled: Callable[[], bool] = lambda: False,
               request_id: str = "") -> Future[Outcome]:
        """The Engine protocol's submit: evidence, every round, the Outcome."""
        return run_request(plan, self.submit_round, is_cancelled, request_id, self.helpers, self.attach_evidence)

    def attach_evidence(self, plan: RequestPlan) -> None:
        attach_evidence(plan, self.model, self.backend, self.gate)

    def submit_round(self, plan: RequestPlan, is_cancelled: Callable[[], bool] = lambda: False,
                     request_id: str = "", specs: list | None = None, tokens: int | None = None) -> Future[RoundResult]:
        """Queue one round of a request; its future is the lane's answer. `specs`, `tokens`: its prompts and
        `round_cost` here, when the caller already has them (replica routing)."""
        specs = plan.prompt_specs() if specs is None else specs
        # what this engine's cache leaves to compute now (planned elsewhere, or the cache changed since)
        tokens = self.round_cost(plan, specs) if tokens is None else tokens
        since = time.perf_counter() if plan.round > 1 else None  # the request's HRRN wait still counts from arrival
        job = Job(plan, tokens, specs, is_cancelled=is_cancelled, arrival=plan.arrival, since=since,
                  request_id=request_id, background=plan.background)
        if not plan.questions:  # every question fixed: nothing to compute
            job.resolve(RoundResult(finish(plan, [], self.model.calibration), 0.0, 0.0, 1, 0))
            return job.future
        self.put(job)
        return job.future

    def describe(self) -> list[dict[str, Any]]:
        return [self.describe_replica()]

    def memory(self) -> dict[str, int]:
        return self.backend.memory()

    def describe_replica(self, alive: bool = True) -> dict[str, Any]:
        """This engine as one replica entry of the Engine protocol's `describe`."""
        now = time.perf_counter()
        lanes = {}
        for lane in self.lanes():
            jobs = list(lane.queue)  # a copy; the lane replaces the list, it never blocks us
            lanes[lane.label] = {"waiting": len(jobs), "waiting_tokens": sum(j.tokens for j in jobs),
                                 "oldest_wait_ms": round(max((now - j.arrival for j in jobs), default=0.0) * 1000.0,
                                                         1)}
        waiting = sum(lane["waiting"] for lane in lanes.values())
        try:
            memory = self.backend.memory()
        except Exception:  # a device that stopped answering still shows in the stats
            memory = {}
        return {"model": self.model.name, "replica": self.replica, "device": self.backend.device, "alive": alive,
                "batches": self.batches, "waiting": waiting, "queued_tokens": self.queued_tokens(),
                "requests": waiting, "lanes": lanes, "memory": memory, "prefix_cache": self.cache_snapshot()}

    def cache_snapshot(self) -> dict[str, Any]:
        if self.cache is None:
            return {"enabled": False, "setting": str(self.settings.prefix_cache), "budget_bytes": 0, "bytes": 0,
                    "peak_bytes": 0, "nodes": 0, "pinned": 0, "tokens": 0, "capacity_tokens": 0, "hits": 0, "misses": 0,
                    "hit_tokens": 0, "evictions": 0}
        return self.cache.snapshot()

    def round_cost(self, plan: RequestPlan, specs: Sequence[Any]) -> int:
        """Tokens a round of `plan` would compute here now (what this engine's cache holds excluded)."""
        if self.cache is None:
            return plan.packed_tokens
        return plan.size_against(self.prefixes) if specs is plan.prompt_specs() else packed_size(specs, self.prefixes)

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

    def launch_batch(self, jobs: Sequence[Job], lane: Lane) -> Flight:
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
        lease, cached = None, None
        if self.cache is None:
            pack = pack_prompts(specs, self.prefixes, s.max_row_tokens, s.max_forward_tokens)
        else:
            # packing, holding what it reads and reserving what it writes: one step against evictions
            with self.cache.lock:
                pack = pack_prompts(specs, self.prefixes, s.max_row_tokens, s.max_forward_tokens)
                lease = self.cache.lease()
                cached = plan_fills(jobs, specs, pack, lease)
        batch_id = self.telemetry.next_batch_id()
        self.telemetry.batch_started(batch_id, self.model.name, lane.label, [j.request_id for j in jobs],
                                     pack.packed_tokens)
        try:
            launched = [self._launch(b, lane) for b in pack.batches]
        except BaseException:
            if lease is not None:
                lease.abort()
            raise
        now = time.perf_counter()
        return Flight(list(jobs), pack, owners, len(specs), launched, batch_id, started, now - started,
                      device_start=now, lease=lease, cached=cached)

    def complete_batch(self, flight: Flight, lane: Lane) -> None:
        """Wait for a launched batch's logits and answer its jobs."""
        jobs, pack, started, batch_id = flight.jobs, flight.pack, flight.started, flight.batch_id
        flight.waited = not flight.done()
        try:
            outputs = [f.result() for f in flight.launched]
        except BaseException:
            if flight.lease is not None:
                flight.lease.abort()
            raise
        if flight.lease is not None:
            flight.lease.commit()
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
            request_ids=[j.request_id for j in jobs], replica=self.replica, device=self.backend.device,
            forward=", ".join(sorted({getattr(f, "kind", "eager") for f in flight.launched})),
            device_ms=_device_ms(flight.launched)))
        for j, job in enumerate(jobs):
            try:
                outcome = finish(job.plan, logits[j], self.model.calibration)
            except Exception as exc:  # one request's answer failing must not take its batch-mates' answers
                log.exception("answer of request %s failed", job.request_id)
                job.fail(exc)
                continue
            queue_ms = (started - (job.arrival if job.since is None else job.since)) * 1000.0
            cached = flight.cached[j] if flight.cached else 0
            job.resolve(RoundResult(outcome, queue_ms, compute_ms, len(jobs), batch_id, cached))


def _device_ms(launched: list[Any]) -> float | None:
    """The device's time for a batch's forwards, where every one of them was timed on it."""
    times = [f.device_s() for f in launched]
    return None if not times or any(t is None for t in times) else round(sum(times) * 1000.0, 3)

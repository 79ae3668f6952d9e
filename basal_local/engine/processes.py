"""Engine replicas in their own processes behind one daemon (`serve --devices ... --replica-processes`).

In-process replicas (replicas.py) share one Python process, so their lane threads and all HTTP handling share
one GIL; on two H200s that left each GPU ~20 % idle. Here the front process keeps HTTP, validation, planning and
routing, and each worker process owns one device: its ModelEngine (lanes, batching, forwards), the evidence
forwards and every round of a request, up to the answer body.

Wire: one duplex `multiprocessing` pipe per worker (forkserver on Linux, spawn elsewhere: CUDA cannot be forked), pickled
messages. Front -> worker: ("job", token, plan, request id), ("cancel", token), ("tree", batch, ask), ("stop",).
Worker -> front: lists of messages, sent by one thread that drains a queue (a burst of answers and events is
one write): ("result", token, fields), ("error", token, error), telemetry ("queued", "started", "failed",
"batch", "count"), ("tree", ask, tree), ("ready", info) / ("load_error", text).

A worker whose pipe ends (its process died) leaves the rotation; every request it had not answered is sent to
the live worker with the least queued tokens (a decision is a pure function of its body, so a retry cannot
double an effect). A worker whose device stops computing (a failed batch, then a failed one-token probe) exits,
which is the same case. Workers ignore SIGINT/SIGTERM and exit when the front says stop or its pipe closes, so
Ctrl-C in a terminal drains through the front and a front killed outright leaves no worker behind.
"""

from __future__ import annotations

import dataclasses
import logging
import multiprocessing
import os
import queue
import signal
import threading
import time
import weakref
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..model.directory import ModelDir
from ..protocol.errors import AnswerRefused, NoEvidenceHead
from ..telemetry import BatchRecord, Telemetry
from .engine import EngineSettings, JobResult, freeze_heap
from .plan import RequestPlan, finish, next_round, plan_request
from .scheduler import Cancelled, EngineStopped, Job

log = logging.getLogger(__name__)

CANCEL_SCAN_S = 0.1  # how often the front looks for requests whose client went away
TREE_WAIT_S = 5.0  # a dashboard's batch tree asked of a worker: how long to wait before it reads as null
MAX_SEND_BATCH = 256  # messages per pipe write from a worker


def _start_context() -> Any:
    """How workers start. CUDA cannot be forked once initialised, so never a plain fork. On Linux a forkserver:
    one clean process imports torch and this module once (it never touches a device) and every worker is a fork
    of it, instead of `spawn`'s fresh interpreter per worker, each importing torch again (7-9 s of CPU apiece on
    a small machine; with 8 GPUs, 8 imports at once). Elsewhere `spawn`."""
    import sys

    if sys.platform.startswith("linux"):
        context = multiprocessing.get_context("forkserver")
        context.set_forkserver_preload(["torch", "numpy", "basal_local.engine.processes"])
        return context
    return multiprocessing.get_context("spawn")


# every replica set of this process: the forkserver is ended only when all of them have stopped (a worker's exit
# status comes through the forkserver, so the others' workers would look dead without it)
_SETS: weakref.WeakSet = weakref.WeakSet()


def _end_forkserver(grace_s: float = 5.0) -> None:
    """End multiprocessing's forkserver once the workers have stopped. It ends by itself when this process exits
    (its "alive" pipe closes), but on a loaded machine a helper process outlived the daemon by more than 30 s in
    tests; ending the forkserver here also closes the resource tracker's last pipe, so that one ends too. The
    standard way (the alive pipe closed), then SIGKILL if it has not ended after `grace_s`. Uses the forkserver's
    private fields (no public API); a no-op where none runs."""
    from multiprocessing import forkserver

    server = getattr(forkserver, "_forkserver", None)
    pid, alive_fd = getattr(server, "_forkserver_pid", None), getattr(server, "_forkserver_alive_fd", None)
    if not isinstance(pid, int):
        return
    try:
        if isinstance(alive_fd, int):
            os.close(alive_fd)
        deadline = time.monotonic() + grace_s
        while os.waitpid(pid, os.WNOHANG) == (0, 0):
            if time.monotonic() > deadline:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                break
            time.sleep(0.02)
    except OSError:  # already reaped, gone, or not ours
        pass
    # as ForkServer.ensure_running leaves a dead server: a later start (tests) begins a new one
    server._forkserver_pid = server._forkserver_alive_fd = server._forkserver_address = None


class RemoteError(RuntimeError):
    """An exception raised in a worker, by type name and text (its class may not unpickle in the front)."""

    def __init__(self, type_name: str, message: str) -> None:
        super().__init__(message)
        self.type_name = type_name


def encode_error(exc: BaseException) -> tuple:
    if isinstance(exc, EngineStopped):
        return ("stopped",)
    if isinstance(exc, Cancelled):
        return ("cancelled",)
    if isinstance(exc, NoEvidenceHead):
        return ("no_evidence_head", exc.qid)
    if isinstance(exc, AnswerRefused):
        return ("refused", exc.qid, exc.message)
    return ("other", type(exc).__name__, str(exc))


def decode_error(data: tuple) -> Exception:
    kind = data[0]
    if kind == "stopped":
        return EngineStopped()
    if kind == "cancelled":
        return Cancelled()
    if kind == "no_evidence_head":
        return NoEvidenceHead(data[1])
    if kind == "refused":
        return AnswerRefused(data[1], data[2])
    return RemoteError(data[1], data[2])


def wire_plan(plan: RequestPlan) -> RequestPlan:
    """The plan as sent: without its tokenizer (the worker has its own) and without the prompt texts, which
    only the evidence forward reads (they repeat the state in every prompt)."""
    evidence = {q.qid for q in plan.request.questions if q.evidence}
    units = [qp if qp.question.qid in evidence else dataclasses.replace(qp, prompts=[]) for qp in plan.questions]
    return dataclasses.replace(plan, questions=units, context=None)


@dataclass
class WorkerSpec:
    """What one worker loads: one model on one device."""

    model_path: Path
    backend: str
    device: str
    dtype: str
    settings: EngineSettings
    replica: int
    log_level: int = logging.WARNING
    gpu_memory: str | float | None = None  # --gpu-memory (backends/memory.py)


# ---------------------------------------------------------------------------------------------- worker side
class _RelayTelemetry(Telemetry):
    """The worker's telemetry: every engine event goes to the front, whose bus and records are the daemon's.
    Batch trees stay here (built only when a dashboard asks, as in one process)."""

    def __init__(self, out: queue.SimpleQueue) -> None:
        super().__init__(history=1, events=1)
        self.out = out
        self.trees: OrderedDict[int, Any] = OrderedDict()

    def emit(self, kind: str, **fields: Any):
        if kind == "queued":
            self.out.put(("queued", fields.get("id", ""), fields.get("lane", "main")))
        return None

    def count(self, name: str, n: int = 1) -> None:
        self.out.put(("count", name, n))

    def batch_started(self, batch_id: int, model: str, lane: str, request_ids: list[str], tokens: int) -> None:
        self.out.put(("started", batch_id, lane, request_ids, tokens))

    def batch_failed(self, model: str, lane: str, exc: BaseException) -> None:
        self.out.put(("failed", lane, f"{type(exc).__name__}: {exc}"))

    def record_batch(self, record: BatchRecord) -> None:
        self.trees[record.batch_id] = record.tree
        while len(self.trees) > 64:  # as Telemetry's KEEP_UNBUILT: old unread trees let their tries go
            self.trees.popitem(last=False)
        fields = dict(record.__dict__)
        fields["tree"] = None
        fields["memory"] = self.memory()
        self.out.put(("batch", fields))


class _RelayLog(logging.Handler):
    """A worker's log records go to the front's loggers (its terminal, log file and dashboard log pane)."""

    def __init__(self, out: queue.SimpleQueue) -> None:
        super().__init__()
        self.out = out

    def emit(self, record: logging.LogRecord) -> None:
        try:
            text = record.getMessage()
            if record.exc_info:
                text += "\n" + logging.Formatter().formatException(record.exc_info)
            self.out.put(("log", record.levelno, record.name, text))
        except Exception:  # logging must never take the worker down
            pass


def _sender(conn, out: queue.SimpleQueue, engine_ref: list, done: threading.Event) -> None:
    """Drain the out-queue into the pipe; also runs the later rounds of large choices (off the lane threads)."""
    while True:
        item = out.get()
        items = [item]
        while len(items) < MAX_SEND_BATCH:
            try:
                items.append(out.get_nowait())
            except queue.Empty:
                break
        batch, stop = [], False
        for it in items:
            if it is None:
                stop = True
            elif it[0] == "_round":  # the next round of a request, or its answer
                message = _after_round(engine_ref[0], *it[1:])
                if message is not None:
                    batch.append(message)
            else:
                batch.append(it)
        if batch:
            try:
                conn.send(batch)
            except (OSError, ValueError):  # the front is gone
                done.set()
                return
        if stop:
            done.set()
            return


class _Worker:
    def __init__(self, engine, out: queue.SimpleQueue) -> None:
        self.engine = engine
        self.out = out
        self.cancelled: set[int] = set()
        self.evidence = ThreadPoolExecutor(2, "basal-evidence")

    def submit(self, token: int, plan: RequestPlan, request_id: str, totals: tuple[float, float] = (0.0, 0.0)):
        def gone() -> bool:
            return token in self.cancelled

        job = self.engine.submit(plan, gone, request_id)
        job.future.add_done_callback(lambda f: self.out.put(("_round", self, token, plan, request_id, f, totals)))

    def job(self, token: int, plan: RequestPlan, request_id: str) -> None:
        model = self.engine.model
        plan.context = (model.tokenizer, model.config.max_position_embeddings, dict(self.engine.prefixes))
        if any(q.evidence for q in plan.request.questions):
            self.evidence.submit(self._with_evidence, token, plan, request_id)
        else:
            self.submit(token, plan, request_id)

    def _with_evidence(self, token: int, plan: RequestPlan, request_id: str) -> None:
        from .evidence import attach_evidence

        try:
            attach_evidence(plan, self.engine)
        except Exception as exc:
            self.out.put(("error", token, encode_error(exc)))
            return
        self.submit(token, plan, request_id)


def _after_round(engine, worker: _Worker, token: int, plan: RequestPlan, request_id: str, future: Future,
                 totals: tuple[float, float]):
    """The answer message of a finished job, or None after queueing the request's next round."""
    try:
        result: JobResult = future.result()
        queue_ms, compute_ms = totals[0] + result.queue_ms, totals[1] + result.compute_ms
        follow = next_round(plan)
        if follow is not None:
            worker.submit(token, follow, request_id, (queue_ms, compute_ms))
            return None
    except BaseException as exc:
        worker.cancelled.discard(token)
        return ("error", token, encode_error(exc))
    worker.cancelled.discard(token)
    fields = {"body": result.body, "queue_ms": queue_ms, "compute_ms": compute_ms,
              "batch_requests": result.batch_requests, "batch_id": result.batch_id, "round": plan.round,
              "input_tokens": plan.input_tokens, "packed_tokens": plan.packed_tokens,
              "planning_s": plan.planning_s, "error": None if plan.error is None else encode_error(plan.error)}
    return ("result", token, fields)


def worker_main(conn, spec: WorkerSpec) -> None:
    """A worker process: load the model on its device, then serve the front's jobs until stop or EOF."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the front drains and then says stop
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    out: queue.SimpleQueue = queue.SimpleQueue()
    root = logging.getLogger()
    root.handlers[:] = [_RelayLog(out)]
    root.setLevel(spec.log_level)
    from basal_local.backends.select import make_backend

    from ..model.directory import load_model_dir
    from .engine import ModelEngine
    from .gate import DeviceGate

    done = threading.Event()
    engine_ref: list = [None]
    try:
        model = load_model_dir(spec.model_path)
        backend = make_backend(spec.backend, spec.device, memory_limit=spec.gpu_memory)
        info = backend.load(model.path, spec.dtype)
        telemetry = _RelayTelemetry(out)
        telemetry.memory_probe = backend.memory
        engine = ModelEngine(model, backend, DeviceGate(spec.settings.long_slice_ms / 1000.0), telemetry,
                             spec.settings, replica=spec.replica)
    except Exception as exc:
        log.debug("loading failed", exc_info=True)
        records = []
        while not out.empty():
            records.append(out.get())
        conn.send([*records, ("load_error", f"replica {spec.replica} on {spec.device}: {exc}")])
        conn.close()
        return
    engine_ref[0] = engine
    freeze_heap()
    worker = _Worker(engine, out)

    def device_gone(eng, exc: Exception, jobs: list[Job]) -> bool:
        try:
            eng.probe()
            return False  # the device computes: the batch itself failed, its requests get the error
        except Exception as probe_exc:
            log.error("replica %d on %s is out of rotation: %s (probe: %s)", spec.replica, spec.device, exc,
                      probe_exc)
        os._exit(3)  # the front sees the pipe close and sends this worker's requests to the others

    engine.on_batch_failure = device_gone
    engine.start()
    sender = threading.Thread(target=_sender, args=(conn, out, engine_ref, done), name="basal-send", daemon=True)
    sender.start()
    out.put(("ready", {"backend": backend.name, "device": backend.device, "dtype": info.dtype, "pid": os.getpid(),
                       "layers": info.layers}))
    try:
        while True:
            try:
                message = conn.recv()
            except (EOFError, OSError):
                break
            kind = message[0]
            if kind == "job":
                worker.job(message[1], message[2], message[3])
            elif kind == "cancel":
                worker.cancelled.add(message[1])
            elif kind == "tree":
                lazy = telemetry.trees.get(message[1])
                out.put(("tree", message[2], lazy.value() if lazy is not None else None))
            elif kind == "stop":
                break
    finally:
        engine.stop(30.0)  # queued jobs fail with EngineStopped (sent back), running batches finish
        out.put(None)
        done.wait(10.0)
        os._exit(0)


# ----------------------------------------------------------------------------------------------- front side
@dataclass
class _Pending:
    token: int
    plan: RequestPlan
    job: Job
    request_id: str
    tokens: int
    cancel_sent: bool = False


class _RemoteLane:
    """What /api/stats shows of a worker's queue: the requests sent to it and not in its running batch."""

    def __init__(self, replica: RemoteReplica) -> None:
        self.replica = replica
        self.label = "main" + (f"-r{replica.replica}" if replica.replica else "")

    @property
    def queue(self) -> list[Job]:
        r = self.replica
        running = r.running_ids
        return [p.job for p in list(r.pending.values()) if p.request_id not in running]


class _RemoteBackend:
    """The name, device and last memory figures of a worker's backend (for /api/ps and /health)."""

    def __init__(self, name: str, device: str) -> None:
        self.name = name
        self.device = device
        self.last_memory: dict[str, int] = {}

    def memory(self) -> dict[str, int]:
        return {k: v for k, v in self.last_memory.items() if not k.startswith("host_")}


class RemoteReplica:
    """The front's handle on one worker process: its pipe, the requests it has not answered, its batch ids."""

    def __init__(self, owner: ProcessReplicaSet, spec: WorkerSpec, context) -> None:
        self.owner = owner
        self.spec = spec
        self.replica = spec.replica
        self.conn, child = context.Pipe(duplex=True)
        self.process = context.Process(target=worker_main, args=(child, spec), name=f"basal-replica-{spec.replica}",
                                       daemon=False)
        self.process.start()
        child.close()  # else the front would hold the worker's end open and never see it die
        self.send_lock = threading.Lock()
        self.pending: dict[int, _Pending] = {}
        self.queued = 0  # packed tokens sent and not answered: the routing cost
        self.alive = False
        self.batches = 0
        self.running_ids: set[str] = set()
        self.batch_ids: OrderedDict[int, int] = OrderedDict()  # the worker's batch id -> the daemon's
        self.backend = _RemoteBackend(spec.backend, spec.device)
        self.info: dict[str, Any] = {}
        self.ready = threading.Event()
        self.load_error: str | None = None
        self.reader = threading.Thread(target=self._read, name=f"basal-replica-{spec.replica}-reader", daemon=True)
        self.reader.start()

    def send(self, message: tuple) -> bool:
        try:
            with self.send_lock:
                self.conn.send(message)
            return True
        except (OSError, ValueError):
            return False

    def _read(self) -> None:
        owner = self.owner
        try:
            while True:
                for message in self.conn.recv():
                    owner.handle(self, message)
        except (EOFError, OSError):
            pass
        except Exception:  # a bug here must still take the worker out and requeue its work
            log.exception("reading from replica %d failed", self.replica)
        owner.lost(self)
        self.ready.set()


class ProcessReplicaSet:
    """The ModelEngine interface the server uses (plan, submit, waiting, lanes, stop), over worker processes."""

    def __init__(self, model: ModelDir, specs: list[WorkerSpec], telemetry: Telemetry,
                 settings: EngineSettings) -> None:
        if not specs:
            raise ValueError("a replica set needs at least one replica")
        self.model = model
        self.telemetry = telemetry
        self.settings = settings
        self.prefixes: dict[str, list[int]] = {}
        if settings.prefix_cache:
            for lang in ("pl", "en"):
                self.prefixes[lang] = model.tokenizer.template_prefix(lang)
        self.dead: set[int] = set()
        self.stopping = False
        _SETS.add(self)
        self._lock = threading.Lock()
        self._tokens = 0
        self._asks: dict[int, Future] = {}
        self.replicas = [RemoteReplica(self, spec, _start_context()) for spec in specs]
        self._scanner = threading.Thread(target=self._scan, name=f"{model.name}-cancel-scan", daemon=True)

    # ---- life ---------------------------------------------------------------------------------------------
    def wait_ready(self, timeout: float | None = None) -> dict[str, Any]:
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
        return self.replicas[0].info

    def start(self) -> None:
        self._scanner.start()

    def stop(self, timeout: float | None = 30.0) -> bool:
        self.stopping = True
        for r in self.replicas:
            r.send(("stop",))
        deadline = time.monotonic() + (30.0 if timeout is None else timeout)
        for r in self.replicas:
            r.process.join(max(0.0, deadline - time.monotonic()))
            if r.process.is_alive():
                log.warning("replica %d did not stop in time; killing it", r.replica)
                r.process.kill()
                r.process.join(5.0)
            r.reader.join(max(0.1, deadline - time.monotonic()))
        self._fail_all(EngineStopped())
        if all(other.stopping for other in list(_SETS)):  # the last set stopped: no worker needs the server
            _end_forkserver()
        return not any(r.process.is_alive() for r in self.replicas)

    # ---- the engine interface ----------------------------------------------------------------------------
    @property
    def backend(self) -> _RemoteBackend:
        live = self.live()
        return (live[0] if live else self.replicas[0]).backend

    @property
    def batches(self) -> int:
        return sum(r.batches for r in self.replicas)

    def live(self) -> list[RemoteReplica]:
        with self._lock:
            return [r for r in self.replicas if r.alive and r.replica not in self.dead]

    def plan(self, request: Any) -> RequestPlan:
        return plan_request(request, self.model.tokenizer, self.model.config.max_position_embeddings, self.prefixes)

    def attach_evidence(self, plan: RequestPlan) -> None:
        """Evidence forwards run in the worker; here only the check that the model has a head (422 early)."""
        wanted = [q for q in plan.request.questions if q.evidence]
        if wanted and self.model.evidence_head is None:
            raise NoEvidenceHead(wanted[0].qid)

    def submit(self, plan: RequestPlan, is_cancelled: Callable[[], bool] = lambda: False,
               request_id: str = "") -> Job:
        job = Job(plan, plan.packed_tokens, [], is_cancelled=is_cancelled, arrival=plan.arrival,
                  request_id=request_id, background=plan.background)
        if not plan.questions:  # every question fixed: nothing to compute
            job.resolve(JobResult(finish(plan, [], self.model.calibration, 0.0), 0.0, 0.0, 1, 0))
            return job
        with self._lock:
            self._tokens += 1
            token = self._tokens
        self._dispatch(_Pending(token, wire_plan(plan), job, request_id, plan.packed_tokens))
        return job

    def _pick(self) -> RemoteReplica | None:
        live = self.live()
        return min(live, key=lambda r: (r.queued, r.replica)) if live else None

    def _dispatch(self, pending: _Pending) -> None:
        while True:
            target = None if self.stopping else self._pick()
            if target is None:
                pending.job.fail(EngineStopped())
                return
            with self._lock:
                if not target.alive:
                    continue
                target.pending[pending.token] = pending
                target.queued += pending.tokens
            if target.send(("job", pending.token, pending.plan, pending.request_id)):
                return
            # the pipe broke: its reader will take the worker out; this request goes elsewhere now
            with self._lock:
                if target.pending.pop(pending.token, None) is None:
                    return  # the reader took it already and re-sent it
                target.queued -= pending.tokens
                target.alive = False

    def waiting(self) -> int:
        return sum(len(r.pending) for r in self.replicas)

    def lanes(self) -> list[_RemoteLane]:
        return [_RemoteLane(r) for r in self.replicas]

    def describe(self) -> list[dict[str, Any]]:
        return [{"model": self.model.name, "replica": r.replica, "device": r.backend.device,
                 "alive": r.alive and r.replica not in self.dead, "batches": r.batches,
                 "waiting": len(_RemoteLane(r).queue), "in_flight": len(r.pending), "queued_tokens": r.queued,
                 "pid": r.process.pid} for r in self.replicas]

    # ---- from the workers (reader threads) ---------------------------------------------------------------
    def _take(self, r: RemoteReplica, token: int) -> _Pending | None:
        with self._lock:
            pending = r.pending.pop(token, None)
            if pending is not None:
                r.queued -= pending.tokens
        return pending

    def _batch_id(self, r: RemoteReplica, local: int) -> int:
        return r.batch_ids.get(local, 0)

    def handle(self, r: RemoteReplica, message: tuple) -> None:
        kind = message[0]
        if kind == "result":
            pending = self._take(r, message[1])
            if pending is None:
                return
            fields = message[2]
            plan = pending.job.plan
            # the worker ran every round: the front's plan takes the last round's figures (and no next round)
            plan.round, plan.planning_s = fields["round"], fields["planning_s"]
            plan.input_tokens, plan.packed_tokens = fields["input_tokens"], fields["packed_tokens"]
            plan.error = None if fields["error"] is None else decode_error(fields["error"])
            pending.job.resolve(JobResult(fields["body"], fields["queue_ms"], fields["compute_ms"],
                                          fields["batch_requests"], self._batch_id(r, fields["batch_id"])))
        elif kind == "error":
            pending = self._take(r, message[1])
            if pending is not None:
                pending.job.fail(decode_error(message[2]))
        elif kind == "queued":
            label = message[2] + (f"-r{r.replica}" if r.replica else "")
            self.telemetry.emit("queued", id=message[1], model=self.model.name, lane=label)
        elif kind == "started":
            _, local, lane, request_ids, tokens = message
            batch_id = self.telemetry.next_batch_id()
            r.batch_ids[local] = batch_id
            while len(r.batch_ids) > 4096:
                r.batch_ids.popitem(last=False)
            r.running_ids = set(request_ids)
            self.telemetry.batch_started(batch_id, self.model.name, lane, request_ids, tokens)
        elif kind == "batch":
            fields = message[1]
            local = fields["batch_id"]
            fields["batch_id"] = self._batch_id(r, local)
            fields["tree"] = self.telemetry.lazy_tree(lambda: self._ask_tree(r, local))
            r.backend.last_memory = fields.get("memory") or {}
            r.batches += 1
            r.running_ids = set()
            self.telemetry.record_batch(BatchRecord(**fields))
        elif kind == "failed":
            r.running_ids = set()
            self.telemetry.batch_failed(self.model.name, message[1], RuntimeError(message[2]))
        elif kind == "log":
            logging.getLogger(message[2]).log(message[1], "replica %d: %s", r.replica, message[3])
        elif kind == "count":
            self.telemetry.count(message[1], message[2])
        elif kind == "tree":
            ask = self._asks.pop(message[1], None)
            if ask is not None:
                ask.set_result(message[2])
        elif kind == "ready":
            r.info = message[1]
            r.backend.name, r.backend.device = message[1]["backend"], message[1]["device"]
            r.alive = True
            r.ready.set()
        elif kind == "load_error":
            r.load_error = message[1]
            r.ready.set()

    def _ask_tree(self, r: RemoteReplica, local: int) -> Any:
        if threading.current_thread() is r.reader or not r.alive:
            return None  # the reader cannot wait for its own next message
        ask: Future = Future()
        with self._lock:
            self._tokens += 1
            number = self._tokens
        self._asks[number] = ask
        if not r.send(("tree", local, number)):
            self._asks.pop(number, None)
            return None
        try:
            return ask.result(TREE_WAIT_S)
        except Exception:
            self._asks.pop(number, None)
            return None

    def lost(self, r: RemoteReplica) -> None:
        """A worker's pipe closed: out of rotation; what it had not answered runs on the others."""
        with self._lock:
            # announced once per replica that had joined the rotation (`ready`): a failed send to it may have marked
            # it not alive already (`_dispatch`), before its reader saw the pipe close
            announce = bool(r.info) and r.replica not in self.dead
            r.alive = False
            self.dead.add(r.replica)
            orphans = list(r.pending.values())
            r.pending.clear()
            r.queued = 0
            r.running_ids = set()
        for pending in orphans:  # first, so that no request waits for the process to be reaped
            if pending.job.future.done():
                continue
            if self.stopping:
                pending.job.fail(EngineStopped())
            else:
                pending.cancel_sent = False
                self._dispatch(pending)
        # then reap it (a forkserver's child: its exit status arrives through the forkserver, a moment later)
        r.process.join(timeout=5)
        if announce and not self.stopping:
            log.error("replica %d of %s on %s is out of rotation: its process ended (exit code %s); %d requests "
                      "went to the others", r.replica, self.model.name, r.backend.device, r.process.exitcode,
                      len(orphans))

    def _fail_all(self, exc: Exception) -> None:
        for r in self.replicas:
            with self._lock:
                orphans = list(r.pending.values())
                r.pending.clear()
                r.queued = 0
            for pending in orphans:
                pending.job.fail(exc)

    def _scan(self) -> None:
        """Tell workers about requests whose client went away (the lane drops them before computing)."""
        while not self.stopping:
            time.sleep(CANCEL_SCAN_S)
            for r in self.replicas:
                for pending in list(r.pending.values()):
                    if not pending.cancel_sent and pending.job.gone():
                        pending.cancel_sent = True
                        r.send(("cancel", pending.token))

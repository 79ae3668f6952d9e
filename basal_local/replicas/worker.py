"""A replica's worker process: one model on one device, serving the front's requests until stop or EOF.

The worker owns its ModelEngine (lanes, batching, forwards) and runs every step of a request there, evidence
and every round included (`ModelEngine.submit`); what goes back is the request's Outcome. Its telemetry and log
records are relayed to the front, whose bus and records are the daemon's; batch trees stay here, built only
when a dashboard asks. Workers ignore SIGINT/SIGTERM and exit when the front says stop or its pipe closes, so
Ctrl-C in a terminal drains through the front and a front killed outright leaves no worker behind. A worker
whose device stops computing (a failed batch, then a failed one-token probe) exits, which the front handles
like a process that died.
"""

from __future__ import annotations

import logging
import os
import queue
import signal
import threading
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from basal_local.backends.select import make_backend
from basal_local.backends.torch.options import TorchOptions

from ..engine.engine import EngineSettings, ModelEngine, freeze_heap
from ..engine.gate import DeviceGate
from ..engine.scheduler import Job
from ..model.directory import load_model_dir
from ..telemetry import BatchRecord, Telemetry
from . import wire

log = logging.getLogger(__name__)
MAX_SEND_BATCH = 256  # messages per pipe write
KEEP_TREES = 64  # as Telemetry's KEEP_UNBUILT: old unread trees let their tries go


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
    torch_options: TorchOptions | None = None  # the torch backend's declared options (None: the defaults)
    device_replicas: int = 1  # replicas of the model on this device (the state cache splits its memory)


class RelayTelemetry(Telemetry):
    """The worker's telemetry: every engine event goes to the front as a wire message."""

    def __init__(self, out: queue.SimpleQueue) -> None:
        super().__init__(history=1, events=1)
        self.out = out
        self.cache_probe: Callable[[], dict[str, Any]] | None = None  # the engine's state cache counters
        self.trees: OrderedDict[int, Any] = OrderedDict()

    def emit(self, kind: str, **fields: Any):
        if kind == "queued":
            self.out.put(wire.Queued(fields.get("id", ""), fields.get("lane", "main")))
        return None

    def count(self, name: str, n: int = 1) -> None:
        self.out.put(wire.Count(name, n))

    def batch_started(self, batch_id: int, model: str, lane: str, request_ids: list[str], tokens: int) -> None:
        self.out.put(wire.BatchStarted(batch_id, lane, list(request_ids), tokens))

    def batch_failed(self, model: str, lane: str, exc: BaseException) -> None:
        self.out.put(wire.BatchFailed(lane, f"{type(exc).__name__}: {exc}"))

    def record_batch(self, record: BatchRecord) -> None:
        self.trees[record.batch_id] = record.tree
        while len(self.trees) > KEEP_TREES:
            self.trees.popitem(last=False)
        fields = dict(record.__dict__)
        fields["tree"] = None
        fields["memory"] = self.memory()
        self.out.put(wire.BatchDone(fields, self.cache_probe() if self.cache_probe is not None else {}))


class RelayLog(logging.Handler):
    """A worker's log records go to the front's loggers (its terminal, log file and dashboard log pane)."""

    def __init__(self, out: queue.SimpleQueue) -> None:
        super().__init__()
        self.out = out

    def emit(self, record: logging.LogRecord) -> None:
        try:
            text = record.getMessage()
            if record.exc_info:
                text += "\n" + logging.Formatter().formatException(record.exc_info)
            self.out.put(wire.Log(record.levelno, record.name, text))
        except Exception:  # logging must never take the worker down
            pass


def _sender(conn, out: queue.SimpleQueue, done: threading.Event) -> None:
    """Drain the out-queue into the pipe, many messages per write; None ends it."""
    while True:
        items = [out.get()]
        while len(items) < MAX_SEND_BATCH:
            try:
                items.append(out.get_nowait())
            except queue.Empty:
                break
        stop = None in items
        batch = [it for it in items if it is not None]
        if batch:
            try:
                conn.send_bytes(wire.ENCODER.encode(batch))
            except (OSError, ValueError):  # the front is gone
                done.set()
                return
        if stop:
            done.set()
            return


class _Requests:
    """The front's requests in this worker: submitted to the engine, answered through the out-queue."""

    def __init__(self, engine: ModelEngine, out: queue.SimpleQueue) -> None:
        self.engine = engine
        self.out = out
        self.cancelled: set[int] = set()

    def submit(self, message: wire.Submit) -> None:
        token = message.token
        plan = wire.decode_plan(message.plan)
        model = self.engine.model
        plan.context = (model.tokenizer, model.config.max_position_embeddings, self.engine.prefixes)
        future = self.engine.submit(plan, lambda: token in self.cancelled, message.request_id)
        future.add_done_callback(lambda f: self._answered(token, f))

    def _answered(self, token: int, future: Future) -> None:
        self.cancelled.discard(token)
        try:
            self.out.put(wire.Answered(token, future.result()))
        except BaseException as exc:
            self.out.put(wire.Failed(token, wire.encode_error(exc)))


def load_engine(spec: WorkerSpec, out: queue.SimpleQueue) -> tuple[ModelEngine, RelayTelemetry, wire.Ready]:
    """The spec's model on its device, its telemetry relayed into `out` (a worker process, a Ray replica)."""
    model = load_model_dir(spec.model_path)
    backend = make_backend(spec.backend, spec.device, memory_limit=spec.gpu_memory,
                           torch_options=spec.torch_options)
    info = backend.load(model.path, spec.dtype)
    telemetry = RelayTelemetry(out)
    telemetry.memory_probe = backend.memory
    engine = ModelEngine(model, backend, DeviceGate(spec.settings.long_slice_ms / 1000.0), telemetry, spec.settings,
                         replica=spec.replica, device_replicas=spec.device_replicas)
    telemetry.cache_probe = engine.cache_snapshot
    return engine, telemetry, wire.Ready(backend.name, backend.device, info.dtype, os.getpid(), info.layers,
                                          backend.memory(), engine.cache_snapshot())


def exit_if_device_gone(engine: ModelEngine, exc: Exception, jobs: list[Job]) -> bool:
    """The lane's hook after a failed batch: probe the device; if it computes, the batch itself failed (its
    requests get the error); if not, end the process, whose front sends its requests to the other replicas."""
    try:
        engine.probe()
        return False
    except Exception as probe_exc:
        log.error("replica %d on %s is out of rotation: %s (probe: %s)", engine.replica, engine.backend.device,
                  exc, probe_exc)
    os._exit(3)


def worker_main(conn, spec: WorkerSpec) -> None:
    """The worker process's entry point."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the front drains and then says stop
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    out: queue.SimpleQueue = queue.SimpleQueue()
    root = logging.getLogger()
    root.handlers[:] = [RelayLog(out)]
    root.setLevel(spec.log_level)
    try:
        engine, telemetry, ready = load_engine(spec, out)
    except Exception as exc:
        log.debug("loading failed", exc_info=True)
        records = []
        while not out.empty():
            records.append(out.get())
        records.append(wire.LoadError(f"replica {spec.replica} on {spec.device}: {exc}"))
        conn.send_bytes(wire.ENCODER.encode([r for r in records if r is not None]))
        conn.close()
        return
    freeze_heap()
    requests = _Requests(engine, out)

    engine.on_batch_failure = exit_if_device_gone
    engine.start()
    done = threading.Event()
    threading.Thread(target=_sender, args=(conn, out, done), name="basal-send", daemon=True).start()
    out.put(ready)
    try:
        while True:
            try:
                message = wire.TO_WORKER.decode(conn.recv_bytes())
            except (EOFError, OSError):
                break
            if isinstance(message, wire.Submit):
                requests.submit(message)
            elif isinstance(message, wire.Cancel):
                requests.cancelled.add(message.token)
            elif isinstance(message, wire.AskTree):
                lazy = telemetry.trees.get(message.batch_id)
                out.put(wire.Tree(message.ask, lazy.value() if lazy is not None else None))
            elif isinstance(message, wire.Stop):
                break
    finally:
        engine.stop(30.0)  # queued requests fail with EngineStopped (sent back), running batches finish
        out.put(None)
        done.wait(10.0)
        os._exit(0)

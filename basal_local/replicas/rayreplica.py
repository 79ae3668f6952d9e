"""One engine replica of `serve --ray` (the Ray Serve deployment "BasalEngine", docs/SCALING.md).

Each replica runs in its own Ray actor on one GPU (or one CPU slot) of some node and holds a ModelEngine per
served model, loaded as a worker process loads it (`worker.load_engine`). It answers the front's requests
(`rayengine.RayEngine`): a `wire.Submit`, encoded, in; a `Reply` out, the request's `wire.Answered` or
`wire.Failed` with the replica's `Report` (its identity, each model's own `describe` entry and the telemetry its
engines emitted since the last reply, which the front replays on its bus). The messages are the worker
processes' (`wire.py`); only the envelope is Ray's.

Nothing here imports Ray at module level: Ray is an optional extra and this module is imported by the tests
without it; `_identity` asks Ray for the replica's names only when it runs inside one.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import queue
from dataclasses import dataclass
from typing import Any

import msgspec

from ..backends.torch.options import TorchOptions
from ..engine.engine import EngineSettings, ModelEngine
from ..model.registry import demo_model_dir, resolve_model
from . import wire
from .worker import RelayTelemetry, WorkerSpec, exit_if_device_gone, load_engine

log = logging.getLogger(__name__)
_LOCAL_IDS = itertools.count(1)  # replicas outside Ray (tests of the class itself)


@dataclass
class ReplicaSpec:
    """What every replica loads: the models (names resolve in each node's own model cache, directories must
    exist at the same path on every node) on the replica's device, with the daemon's engine settings."""

    model_refs: list[str]
    backend: str
    device: str  # cuda (one GPU per actor: Ray sets CUDA_VISIBLE_DEVICES) or cpu
    dtype: str
    settings: EngineSettings
    demo: bool = False  # the demo model first, prepared on each node
    log_level: int = logging.WARNING
    gpu_memory: str | float | None = None
    torch_options: TorchOptions | None = None


class ModelReport(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    describe: dict[str, Any]  # the engine's own `describe_replica()` entry
    relay: list[wire.ToFront] = []  # telemetry since the last report (Queued, BatchStarted, BatchDone, ...)


class Report(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    replica_id: str  # Ray Serve's replica id: a replacement has a new one
    actor_id: str  # the actor's id, which a RayActorError names when this replica's process died
    pid: int
    backend: str
    device: str
    dtype: str
    models: dict[str, ModelReport] = {}


class Reply(msgspec.Struct, array_like=True, gc=False):
    answer: wire.Answered | wire.Failed
    report: Report


REPLY = msgspec.msgpack.Decoder(Reply)
REPORT = msgspec.msgpack.Decoder(Report)
SUBMIT = msgspec.msgpack.Decoder(wire.Submit)


class EngineReplica:
    """The deployment's class: the engines, loaded in the actor's constructor, and the calls the front makes."""

    def __init__(self, spec: ReplicaSpec) -> None:
        logging.getLogger("basal_local").setLevel(spec.log_level)
        self.replica_id, self.actor_id = _identity()
        self.engines: dict[str, ModelEngine] = {}
        self.relays: dict[str, queue.SimpleQueue] = {}
        self.telemetry: dict[str, RelayTelemetry] = {}
        self.stopping = False
        paths = [resolve_model(ref) for ref in spec.model_refs]  # in this node's model cache
        if spec.demo:
            paths.insert(0, demo_model_dir())
        ready = None
        for path in paths:
            out: queue.SimpleQueue = queue.SimpleQueue()
            worker = WorkerSpec(path, spec.backend, spec.device, spec.dtype, spec.settings, replica=0,
                                log_level=spec.log_level, gpu_memory=spec.gpu_memory,
                                torch_options=spec.torch_options)
            engine, telemetry, ready = load_engine(worker, out)
            if engine.model.name in self.engines:
                raise ValueError(f"two models are named {engine.model.name!r} (basal.json name)")
            engine.on_batch_failure = exit_if_device_gone  # Ray replaces the actor; the front retries elsewhere
            engine.start()
            self.engines[engine.model.name] = engine
            self.relays[engine.model.name] = out
            self.telemetry[engine.model.name] = telemetry
        if ready is None:
            raise ValueError("a replica needs at least one model")
        self.ready = ready
        log.info("replica %s (pid %d) serves %s on %s", self.replica_id, os.getpid(), ", ".join(self.engines),
                 ready.device)

    async def submit(self, model: str, data: bytes) -> bytes:
        """Run one request (a `wire.Submit`) to its Outcome; the reply names this replica and carries its
        report. Ray cancels the call when the front's client went away: the engine then drops the request."""
        message = SUBMIT.decode(data)
        cancelled = False
        engine = self.engines.get(model)
        if engine is None:
            answer: wire.Answered | wire.Failed = wire.Failed(message.token, wire.WireError(
                "other", message=f"this replica does not serve {model!r}", type_name="KeyError"))
            return wire.ENCODER.encode(Reply(answer, self._report([model])))
        plan = wire.decode_plan(message.plan)
        plan.context = (engine.model.tokenizer, engine.model.config.max_position_embeddings, engine.prefixes)
        future = engine.submit(plan, lambda: cancelled, message.request_id)
        try:
            answer = wire.Answered(message.token, await asyncio.wrap_future(future))
        except asyncio.CancelledError:
            cancelled = True
            raise
        except Exception as exc:
            answer = wire.Failed(message.token, wire.encode_error(exc))
        return wire.ENCODER.encode(Reply(answer, self._report([model])))

    def report(self) -> bytes:
        """What the front polls (a broadcast to every replica): this replica and each of its models."""
        return wire.ENCODER.encode(self._report(list(self.engines)))

    def _report(self, models: list[str]) -> Report:
        out = {}
        for name in models:
            engine, relay = self.engines.get(name), self.relays.get(name)
            if engine is None or relay is None:
                continue
            messages = []
            while True:
                try:
                    messages.append(relay.get_nowait())
                except queue.Empty:
                    break
            out[name] = ModelReport(engine.describe_replica(), [m for m in messages if m is not None])
        ready = self.ready
        return Report(self.replica_id, self.actor_id, os.getpid(), ready.backend, ready.device, ready.dtype, out)

    def tree(self, replica_id: str, model: str, batch_id: int) -> Any:
        """A batch's tree, built when a dashboard asks (a broadcast: None from every other replica, and once the
        tree is no longer kept)."""
        if replica_id != self.replica_id:
            return None
        telemetry = self.telemetry.get(model)
        lazy = telemetry.trees.get(batch_id) if telemetry is not None else None
        return lazy.value() if lazy is not None else None

    def check_health(self) -> None:
        """Ray Serve's periodic probe: a replica that is stopping is replaced."""
        if self.stopping or not self.engines:
            raise RuntimeError("the replica is not serving")

    def close(self) -> None:
        """Stop the engines (queued requests fail with "engine stopped"); called again, it does nothing."""
        engines, self.engines = getattr(self, "engines", {}), {}
        self.stopping = True
        for engine in engines.values():
            engine.stop(5.0)

    def __del__(self) -> None:  # Ray Serve deletes the replica's object when it takes the replica down
        self.close()


def _identity() -> tuple[str, str]:
    """(Ray Serve's replica id, the actor's id); outside Ray (tests of the class itself) a name from the pid."""
    try:
        import ray  # optional extra: only inside a Ray actor
        from ray import serve

        return serve.get_replica_context().replica_id.unique_id, ray.get_runtime_context().get_actor_id() or ""
    except Exception:
        # a fresh name per replica (the id of a temporary object would repeat: its memory is reused at once)
        return f"local-{os.getpid()}-{next(_LOCAL_IDS)}", ""

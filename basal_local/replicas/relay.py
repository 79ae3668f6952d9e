"""What a front of remote replicas does the same way for worker processes (`front.py`) and Ray replicas
(`rayengine.py`): `relay` replays a replica's telemetry on the front's bus, `answered_here` answers a request that
needs no replica, `resolve` and `fail` settle a future that its waiter may have cancelled meanwhile.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent.futures import Future, InvalidStateError
from typing import Any

from ..engine.plan import RequestPlan, finish
from ..model.directory import ModelDir
from ..protocol.errors import NoEvidenceHead
from ..protocol.outcome import Outcome
from ..telemetry import BatchRecord, Telemetry
from . import wire


def resolve(future: Future, outcome: Outcome) -> None:
    """The future's outcome, unless its waiter cancelled it."""
    try:
        future.set_result(outcome)
    except InvalidStateError:  # the waiter cancelled it
        pass


def fail(future: Future, exc: BaseException) -> None:
    """The future's error, unless its waiter cancelled it."""
    try:
        future.set_exception(exc)
    except InvalidStateError:
        pass


def answered_here(plan: RequestPlan, model: ModelDir) -> Future[Outcome]:
    """A future already done when the front can answer without a replica (an evidence question without the
    model's evidence head: the replica would refuse it; every question fixed: nothing to compute), else a
    pending one for the caller to resolve."""
    future: Future[Outcome] = Future()
    wanted = [q for q in plan.request.questions if q.evidence]
    if wanted and model.evidence_head is None:
        future.set_exception(NoEvidenceHead(wanted[0].qid))
    elif not plan.questions:
        outcome = finish(plan, [], model.calibration)
        if outcome is None:
            raise RuntimeError("a plan without units asked for another round")
        future.set_result(outcome)
    return future


def relay(telemetry: Telemetry, model: str, r: Any, message: Any, tree: Callable[[int], Any]) -> None:
    """Replay one of a replica's telemetry messages on the front's bus (worker processes and Ray replicas).
    `r` keeps the replica's view: `replica`, `batch_ids` (its batch id -> the front's), `running_ids`,
    `last_memory`, `last_cache`, `batches`; `tree(local_id)` builds a batch's tree when a dashboard asks."""
    if isinstance(message, wire.Queued):
        label = message.lane + (f"-r{r.replica}" if r.replica else "")
        telemetry.emit("queued", id=message.request_id, model=model, lane=label)
    elif isinstance(message, wire.BatchStarted):
        batch_id = telemetry.next_batch_id()
        r.batch_ids[message.batch_id] = batch_id
        while len(r.batch_ids) > 4096:
            r.batch_ids.popitem(last=False)
        r.running_ids = set(message.request_ids)
        telemetry.batch_started(batch_id, model, message.lane, message.request_ids, message.tokens)
    elif isinstance(message, wire.BatchDone):
        fields = message.fields
        local = fields["batch_id"]
        fields["batch_id"] = r.batch_ids.get(local, 0)
        fields["tree"] = telemetry.lazy_tree(lambda: tree(local))
        r.last_memory = fields.get("memory") or {}
        if message.cache:
            r.last_cache = dict(message.cache)
        r.batches += 1
        r.running_ids = set()
        telemetry.record_batch(BatchRecord(**fields))
    elif isinstance(message, wire.BatchFailed):
        r.running_ids = set()
        telemetry.batch_failed(model, message.lane, RuntimeError(message.text))
    elif isinstance(message, wire.Log):
        logging.getLogger(message.name).log(message.level, "replica %d: %s", r.replica, message.text)
    elif isinstance(message, wire.Count):
        telemetry.count(message.name, message.n)


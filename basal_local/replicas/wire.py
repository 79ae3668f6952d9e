"""What crosses the pipe between the front and a replica's worker process: declared msgspec structs.

Front -> worker: `Submit` (a plan, pickled, without its planning context and, once tokenized, without the texts
no later step reads), `Cancel`, `AskTree`, `Stop`. Worker -> front, a list per write (a burst of answers and
events is one write): `Answered` (the request's Outcome), `Failed`, the telemetry relay (`Queued`,
`BatchStarted`, `BatchFailed`, `BatchDone`, `Count`, `Log`), `Tree`, `Ready` / `LoadError`.
"""

from __future__ import annotations

import dataclasses
import pickle
from typing import Any

import msgspec

from ..engine.plan import RequestPlan
from ..engine.scheduler import Cancelled, EngineStopped
from ..protocol.errors import AnswerRefused, NoEvidenceHead
from ..protocol.outcome import Outcome

_STRUCT = {"array_like": True, "omit_defaults": True, "gc": False}


class Submit(msgspec.Struct, tag="submit", **_STRUCT):
    token: int
    request_id: str
    plan: bytes  # `encode_plan`


class Cancel(msgspec.Struct, tag="cancel", **_STRUCT):
    token: int


class AskTree(msgspec.Struct, tag="ask_tree", **_STRUCT):
    batch_id: int  # the worker's own batch id
    ask: int


class Stop(msgspec.Struct, tag="stop", **_STRUCT):
    pass


class WireError(msgspec.Struct, **_STRUCT):
    kind: str  # stopped | cancelled | no_evidence_head | refused | other
    qid: str = ""
    message: str = ""
    type_name: str = ""


class Answered(msgspec.Struct, tag="answered", **_STRUCT):
    token: int
    outcome: Outcome


class Failed(msgspec.Struct, tag="failed", **_STRUCT):
    token: int
    error: WireError


class Queued(msgspec.Struct, tag="queued", **_STRUCT):
    request_id: str
    lane: str


class BatchStarted(msgspec.Struct, tag="batch_started", **_STRUCT):
    batch_id: int
    lane: str
    request_ids: list[str]
    tokens: int


class BatchFailed(msgspec.Struct, tag="batch_failed", **_STRUCT):
    lane: str
    text: str


class BatchDone(msgspec.Struct, tag="batch_done", **_STRUCT):
    fields: dict[str, Any]  # telemetry.BatchRecord's fields, the tree left in the worker
    cache: dict[str, Any] = msgspec.field(default_factory=dict)  # the worker's state cache after it (/api/stats)


class Count(msgspec.Struct, tag="count", **_STRUCT):
    name: str
    n: int


class Log(msgspec.Struct, tag="log", **_STRUCT):
    level: int
    name: str
    text: str


class Tree(msgspec.Struct, tag="tree", **_STRUCT):
    ask: int
    tree: Any


class Ready(msgspec.Struct, tag="ready", **_STRUCT):
    backend: str
    device: str
    dtype: str
    pid: int
    layers: int
    memory: dict[str, int] = msgspec.field(default_factory=dict)  # the device's, once loaded (`basal-local ps`)
    cache: dict[str, Any] = msgspec.field(default_factory=dict)  # its state cache (the templates), once loaded


class LoadError(msgspec.Struct, tag="load_error", **_STRUCT):
    text: str


ToWorker = Submit | Cancel | AskTree | Stop
ToFront = Answered | Failed | Queued | BatchStarted | BatchFailed | BatchDone | Count | Log | Tree | Ready | LoadError

ENCODER = msgspec.msgpack.Encoder()
TO_WORKER = msgspec.msgpack.Decoder(ToWorker)
TO_FRONT = msgspec.msgpack.Decoder(list[ToFront])


class RemoteError(RuntimeError):
    """An exception raised in a worker, by type name and text (its class may not exist in the front)."""

    def __init__(self, type_name: str, message: str) -> None:
        super().__init__(message)
        self.type_name = type_name


def encode_error(exc: BaseException) -> WireError:
    if isinstance(exc, EngineStopped):
        return WireError("stopped")
    if isinstance(exc, Cancelled):
        return WireError("cancelled")
    if isinstance(exc, NoEvidenceHead):
        return WireError("no_evidence_head", exc.qid or "")
    if isinstance(exc, AnswerRefused):
        return WireError("refused", exc.qid, exc.message)
    return WireError("other", message=str(exc), type_name=type(exc).__name__)


def decode_error(error: WireError) -> Exception:
    if error.kind == "stopped":
        return EngineStopped()
    if error.kind == "cancelled":
        return Cancelled()
    if error.kind == "no_evidence_head":
        return NoEvidenceHead(error.qid)
    if error.kind == "refused":
        return AnswerRefused(error.qid, error.message)
    return RemoteError(error.type_name, error.message)


def encode_plan(plan: RequestPlan) -> bytes:
    """The plan as sent: without its planning context (the worker has its own tokenizer), without the prompt
    texts, which only the evidence forward reads, and without the state text unless a later step reads it (the
    evidence spans, a large choice's second round): it is already in every prompt's tokens."""
    evidence = {q.qid for q in plan.request.questions if q.evidence}
    units = [qp if qp.question.qid in evidence else dataclasses.replace(qp, head="", tails=[]) for qp in plan.questions]
    request = plan.request
    if not evidence and not any(q.large for q in request.questions):
        request = dataclasses.replace(request, state_text="")
    return pickle.dumps(dataclasses.replace(plan, request=request, questions=units, context=None), protocol=5)


def decode_plan(data: bytes) -> RequestPlan:
    return pickle.loads(data)

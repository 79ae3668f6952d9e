"""The `Engine` protocol: what the server needs of any engine kind (DESIGN.md "The Engine protocol").

One model on one device (`engine.ModelEngine`), several in-process replicas (`replicas.ReplicaSet`), replicas
in worker processes (`replicas.ProcessReplicaSet`), replicas in a Ray Serve deployment (`replicas.RayEngine`):
the server awaits one future per request and knows none of them by kind.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, Protocol, runtime_checkable

from ..model.directory import ModelDir
from ..protocol.outcome import Outcome
from ..protocol.questions import DecisionRequest
from .plan import RequestPlan


class EngineUnavailable(Exception):
    """No replica of the model can compute now (every worker died and is restarting): the server answers 503 with
    `retry_after_s` as the client's Retry-After."""

    def __init__(self, reason: str, retry_after_s: int = 5) -> None:
        super().__init__(reason)
        self.retry_after_s = max(1, int(retry_after_s))


@runtime_checkable
class Engine(Protocol):
    model: ModelDir

    def plan(self, request: DecisionRequest) -> RequestPlan:
        """Render, tokenize and size a validated request (raises ContextTooLong); runs on the caller's thread."""
        ...

    def submit(self, plan: RequestPlan, is_cancelled: Callable[[], bool] = ..., request_id: str = "") -> Future[Outcome]:
        """Queue the request: its evidence forwards, every round of a large choice, its answer. The future fails
        with Cancelled (the client left), EngineStopped, EngineUnavailable, a protocol error (NoEvidenceHead) or the batch's error."""
        ...

    def describe(self) -> list[dict[str, Any]]:
        """One entry per replica: model, replica, device, alive, batches, waiting, queued_tokens (what /health and
        /api/stats show, with a process replica's in_flight and pid), and for the server's own use `requests` (held
        and not answered), `lanes` (label -> waiting, waiting_tokens, oldest_wait_ms) and `memory` (the device's)."""
        ...

    def memory(self) -> dict[str, int]:
        """The device memory of its last replica (weights, graphs, cache, allocated, peak, in bytes): what the
        telemetry samples while this engine is loaded."""
        ...

    def stop(self, timeout: float | None = 30.0) -> bool:
        """Fail queued requests with EngineStopped, let running batches finish; whether everything ended in time."""
        ...

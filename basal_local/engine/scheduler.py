"""Queue order and batch formation (ENGINE.md §3): HRRN or FIFO, trie-growth budget per batch."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass, field
from typing import Any

from .packer import PromptSpec, TrieSizer

RATE_START = 3000.0  # tokens/s before anything was measured
MAX_REJECTIONS = 64  # stop scanning the queue for batch-mates after this many misfits


class Cancelled(Exception):
    """The client went away before its request was computed."""


class EngineStopped(Exception):
    """The model's engine stopped (daemon shutdown) before the request was computed."""

    def __init__(self) -> None:
        super().__init__("engine stopped")


@dataclass
class Job:
    plan: Any  # RequestPlan (kept loose so schedulers can be tested with stand-ins)
    tokens: int
    specs: Sequence[PromptSpec]
    future: Future = field(default_factory=Future)
    is_cancelled: Callable[[], bool] = lambda: False
    arrival: float = field(default_factory=time.perf_counter)
    request_id: str = ""

    def gone(self) -> bool:
        """Whether nobody waits for the answer: the client disconnected or the awaiting task was cancelled."""
        if self.future.done():  # cancelled by the waiter (or already answered)
            return True
        try:
            return bool(self.is_cancelled())
        except Exception:  # a broken flag must not stop the lane; the job just runs
            return False

    # The waiter may cancel the future at any moment (server shutdown, a server-side timeout), so setting
    # it can race with that: a future that is no longer pending is simply left alone.
    def resolve(self, result: Any) -> None:
        try:
            self.future.set_result(result)
        except InvalidStateError:
            pass

    def fail(self, exc: BaseException) -> None:
        try:
            self.future.set_exception(exc)
        except InvalidStateError:
            pass


def hrrn_order(jobs: list[Job], now: float, rate: float) -> list[Job]:
    """Highest response ratio first: (wait + est) / est with est = tokens / rate. Stable for ties."""
    return sorted(jobs, key=lambda j: -(now - j.arrival) * rate / max(j.tokens, 1))


def form_batch(queue: list[Job], max_batch_tokens: int, prefixes: dict[str, Sequence[int]],
               schedule: str, rate: float, now: float | None = None) -> tuple[list[Job], list[Job]]:
    """Take the first job in queue order and each later one whose trie growth still fits the budget.

    Returns (batch, rest), the rest in that queue order. A job larger than the budget runs alone.
    """
    now = time.perf_counter() if now is None else now
    ordered = hrrn_order(queue, now, rate) if schedule == "hrrn" else list(queue)
    if not ordered:
        return [], []
    batch = [ordered[0]]
    sizer = TrieSizer(prefixes)
    sizer.add(ordered[0].specs)
    rest: list[Job] = []
    rejections = 0
    for job in ordered[1:]:
        if rejections >= MAX_REJECTIONS or sizer.tokens >= max_batch_tokens:
            rest.append(job)
            continue
        if sizer.tokens + job.tokens <= max_batch_tokens:
            sizer.add(job.specs)
            batch.append(job)
            continue
        # its own size does not fit; shared prefixes with the batch may still make it fit
        trial = TrieSizer(prefixes)
        for member in batch:
            trial.add(member.specs)
        trial.add(job.specs)
        if trial.tokens <= max_batch_tokens:
            sizer = trial
            batch.append(job)
        else:
            rejections += 1
            rest.append(job)
    return batch, rest

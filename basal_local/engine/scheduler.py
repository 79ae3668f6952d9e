"""Queue order and batch formation: HRRN or FIFO, trie-growth budget per batch."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass, field
from typing import Any

from .packer import PromptSpec, TrieSizer

RATE_START = 3000.0  # tokens/s before anything was measured
# Fixed cost of running a batch at all (launches, packing, host math, answering), whatever its size. With it in
# the estimate, est = overhead + tokens / rate, the measured rate decides how much size matters: on a fast device
# every job costs about the overhead and the order tends to FIFO; on a slow one it tends to shortest-first.
BATCH_OVERHEAD_S = 0.005
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
    since: float | None = None  # when a round after the first was queued (its queue time starts there, not at arrival)
    background: bool = False  # batch work (the Batch API): after every interactive job, never beside one
    # the state cache's `in_flight` for this job's document, as of (`pending_changes`, `generation`) (lane.py)
    in_flight: tuple[tuple[int, int], bool] | None = None

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


BACKGROUND_SHARE = 4  # a background batch holds at most this fraction (1/4) of max_batch_tokens


def estimate_s(tokens: int, rate: float, overhead_s: float = BATCH_OVERHEAD_S) -> float:
    """Estimated compute time of a job alone: the fixed batch cost plus its tokens at the measured rate."""
    return overhead_s + max(tokens, 1) / rate


def response_ratio(job: Job, now: float, rate: float, overhead_s: float = BATCH_OVERHEAD_S) -> float:
    """docs/ARCHITECTURE.md's priority (wait + est) / est."""
    est = estimate_s(job.tokens, rate, overhead_s)
    return (max(now - job.arrival, 0.0) + est) / est


def hrrn_order(jobs: list[Job], now: float, rate: float, overhead_s: float = BATCH_OVERHEAD_S) -> list[Job]:
    """Interactive jobs first, then background ones; each by highest response ratio (`response_ratio`);
    ties keep queue order."""
    return sorted(jobs, key=lambda j: (j.background, -response_ratio(j, now, rate, overhead_s)))


def form_batch(queue: list[Job], max_batch_tokens: int, prefixes: Any,
               schedule: str, rate: float, now: float | None = None,
               overhead_s: float = BATCH_OVERHEAD_S) -> tuple[list[Job], list[Job]]:
    """Take the first job in queue order and each later one whose trie growth still fits the budget.

    Growth counts what a job adds to the batch's prefix tries, so a prefix it shares with members already
    taken (the same state, the same template) counts once. Returns (batch, rest), the rest in queue order.
    A job larger than the budget runs alone; a budget of 0 makes every batch one job (the long lane).
    """
    now = time.perf_counter() if now is None else now
    if schedule == "hrrn":
        ordered = hrrn_order(queue, now, rate, overhead_s)
    else:
        ordered = sorted(queue, key=lambda j: j.background)  # stable: FIFO within each class
    if ordered and not ordered[0].background:  # background work never rides in an interactive batch
        waiting = [j for j in ordered if j.background]
        ordered = [j for j in ordered if not j.background]
    else:
        # background batches stay small: an interactive request arriving meanwhile waits for one of them at most
        waiting = []
        max_batch_tokens = max(1, max_batch_tokens // BACKGROUND_SHARE) if max_batch_tokens else 0
    batch, rest = _fill(ordered, max_batch_tokens, prefixes)
    return batch, rest + waiting


def _fill(ordered: list[Job], max_batch_tokens: int,
          prefixes: Any) -> tuple[list[Job], list[Job]]:
    if len(ordered) <= 1:  # nothing to size against (a job larger than the budget runs alone anyway)
        return ordered, []
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

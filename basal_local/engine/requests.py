"""One request from its plan to its Outcome, for every engine kind: the evidence forwards, every round of a large
choice, the timings summed over the rounds.

An engine gives `run_request` how to queue one round (`RoundSubmit`: a future of the round's `RoundResult`) and
how to run the evidence forwards; the rounds after the first and the evidence run on the engine's helper threads,
never on a lane thread or the caller's.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Executor, Future, InvalidStateError
from dataclasses import dataclass

from ..protocol.outcome import Outcome
from .plan import RequestPlan, next_round
from .scheduler import EngineStopped


@dataclass
class RoundResult:
    """What a lane answers for one round of a request."""

    outcome: Outcome | None  # None: another round follows (a large choice's finalists)
    queue_ms: float
    compute_ms: float
    batch_requests: int
    batch_id: int
    cached_tokens: int = 0  # tokens of its prompts continued from cached K/V (the template, a cached state)


RoundSubmit = Callable[[RequestPlan, Callable[[], bool], str], "Future[RoundResult]"]


def _fail(future: Future, exc: BaseException) -> None:
    try:  # the waiter may have cancelled it meanwhile
        future.set_exception(exc)
    except InvalidStateError:
        pass


def _offload(helpers: Executor, outer: Future, work: Callable[[], None]) -> None:
    try:
        helpers.submit(work)
    except RuntimeError:  # the engine stopped: its helper threads are shut down
        _fail(outer, EngineStopped())


def run_request(plan: RequestPlan, submit_round: RoundSubmit, is_cancelled: Callable[[], bool], request_id: str,
                helpers: Executor, evidence: Callable[[RequestPlan], None] | None = None) -> Future[Outcome]:
    """The future of the request's Outcome. A waiter that cancels it drops the request (its rounds see `gone`)."""
    run = _Run(plan, submit_round, is_cancelled, request_id, helpers)
    if evidence is not None and any(q.evidence for q in plan.request.questions):
        _offload(helpers, run.outer, lambda: run.with_evidence(evidence))
    else:
        run.submit(plan)
    return run.outer


class _Run:
    """One request's rounds. An object, not nested closures: closures that call each other form a reference
    cycle per request (with its futures, plan and outcome), garbage that only the cycle collector frees; a
    daemon then paused for a generation-1 collection every ~150 requests (~3 ms on the CPU)."""

    def __init__(self, plan: RequestPlan, submit_round: RoundSubmit, is_cancelled: Callable[[], bool],
                 request_id: str, helpers: Executor) -> None:
        self.outer: Future[Outcome] = Future()
        self.plan, self.submit_round, self.is_cancelled = plan, submit_round, is_cancelled
        self.request_id, self.helpers = request_id, helpers
        self.totals = [0.0, 0.0]  # queue and compute ms over the rounds
        self.current = plan  # the round in flight (one at a time)

    def gone(self) -> bool:
        return self.outer.done() or bool(self.is_cancelled())

    def submit(self, current: RequestPlan) -> None:
        self.current = current
        try:
            future = self.submit_round(current, self.gone, self.request_id)
        except BaseException as exc:
            _fail(self.outer, exc)
            return
        future.add_done_callback(self.after)

    def after(self, future: Future) -> None:
        try:
            result: RoundResult = future.result()
        except BaseException as exc:
            _fail(self.outer, exc)
            return
        self.totals[0] += result.queue_ms
        self.totals[1] += result.compute_ms
        if result.outcome is None:
            _offload(self.helpers, self.outer, self.plan_next)
            return
        outcome = result.outcome
        outcome.queue_ms, outcome.compute_ms = self.totals
        outcome.batch_requests, outcome.batch_id = result.batch_requests, result.batch_id
        outcome.cached_tokens = result.cached_tokens
        try:
            self.outer.set_result(outcome)
        except InvalidStateError:
            pass

    def plan_next(self) -> None:
        try:
            follow = next_round(self.current)
            if follow is None:
                raise RuntimeError("a round answered no outcome and no round follows it")
        except BaseException as exc:
            _fail(self.outer, exc)
            return
        self.submit(follow)

    def with_evidence(self, evidence: Callable[[RequestPlan], None]) -> None:
        try:
            evidence(self.plan)
        except BaseException as exc:
            _fail(self.outer, exc)
            return
        self.submit(self.plan)

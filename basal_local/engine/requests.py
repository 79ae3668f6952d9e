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
    outer: Future[Outcome] = Future()
    totals = [0.0, 0.0]  # queue and compute ms over the rounds

    def gone() -> bool:
        return outer.done() or bool(is_cancelled())

    def submit(current: RequestPlan) -> None:
        try:
            future = submit_round(current, gone, request_id)
        except BaseException as exc:
            _fail(outer, exc)
            return
        future.add_done_callback(lambda f: after(current, f))

    def after(current: RequestPlan, future: Future) -> None:
        try:
            result: RoundResult = future.result()
        except BaseException as exc:
            _fail(outer, exc)
            return
        totals[0] += result.queue_ms
        totals[1] += result.compute_ms
        if result.outcome is None:
            _offload(helpers, outer, lambda: plan_next(current))
            return
        outcome = result.outcome
        outcome.queue_ms, outcome.compute_ms = totals
        outcome.batch_requests, outcome.batch_id = result.batch_requests, result.batch_id
        outcome.cached_tokens = result.cached_tokens
        try:
            outer.set_result(outcome)
        except InvalidStateError:
            pass

    def plan_next(current: RequestPlan) -> None:
        try:
            follow = next_round(current)
            if follow is None:
                raise RuntimeError("a round answered no outcome and no round follows it")
        except BaseException as exc:
            _fail(outer, exc)
            return
        submit(follow)

    def with_evidence() -> None:
        try:
            evidence(plan)  # type: ignore[misc]
        except BaseException as exc:
            _fail(outer, exc)
            return
        submit(plan)

    if evidence is not None and any(q.evidence for q in plan.request.questions):
        _offload(helpers, outer, with_evidence)
    else:
        submit(plan)
    return outer

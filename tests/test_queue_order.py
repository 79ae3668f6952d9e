"""Queue order and batch formation as pure functions with an injected clock (docs/ARCHITECTURE.md, docs/ARCHITECTURE.md "Scheduling").

Expected values come from the formulas of docs/ARCHITECTURE.md "Scheduling" written out here: priority = (wait + est) / est, with
est = fixed batch overhead + tokens / rate; a batch takes the first job and each later one whose packed growth
(shared prefixes counted once) still fits `max_batch_tokens`.
"""

from __future__ import annotations

import itertools

import pytest

from basal_local.engine.packer import PromptSpec
from basal_local.engine.scheduler import BATCH_OVERHEAD_S, Job, form_batch, hrrn_order

_ids = itertools.count(10_000)


def job(tokens: int, arrival: float, name: str = "", ids: list[int] | None = None) -> Job:
    """A stand-in job: one prompt of `tokens` fresh token ids (shares nothing) unless ids are given."""
    ids = ids if ids is not None else [next(_ids) for _ in range(tokens)]
    return Job(plan=name, tokens=len(ids), specs=[PromptSpec(ids, "en", [1, 2])],
               arrival=arrival, request_id=name)


def names(jobs: list[Job]) -> list[str]:
    return [j.request_id for j in jobs]


def expected_priority(tokens: int, wait: float, rate: float, overhead: float) -> float:
    est = overhead + tokens / rate
    return (wait + est) / est


def test_hrrn_order_is_the_design_priority():
    now, rate, overhead = 10.0, 2000.0, 0.005
    jobs = [job(t, now - w, f"j{i}") for i, (t, w) in enumerate(
        [(10, 0.01), (4000, 3.0), (300, 0.5), (10, 0.2), (1200, 1.0), (50, 0.05), (50, 0.05)])]
    got = hrrn_order(jobs, now, rate, overhead_s=overhead)
    # sorted() is stable: equal priorities keep queue order (j5 before j6)
    want = sorted(jobs, key=lambda j: -expected_priority(j.tokens, now - j.arrival, rate, overhead))
    assert names(got) == names(want)
    assert names(got).index("j5") < names(got).index("j6")


def test_the_measured_rate_changes_the_order():
    """With a fixed per-batch cost in the estimate, a fast device weighs waiting more than size."""
    now = 100.0
    small = job(100, now - 1.0, "small")  # waited 1 s
    big = job(1000, now - 5.0, "big")  # waited 5 s
    for rate in (1_000.0, 1_000_000.0):
        p_small = expected_priority(100, 1.0, rate, BATCH_OVERHEAD_S)
        p_big = expected_priority(1000, 5.0, rate, BATCH_OVERHEAD_S)
        want = ["small", "big"] if p_small > p_big else ["big", "small"]
        assert names(hrrn_order([small, big], now, rate)) == want
        assert names(hrrn_order([big, small], now, rate)) == want
    # the two rates must disagree, or this test could not tell a rate-blind order apart
    assert names(hrrn_order([small, big], now, 1_000.0)) != names(hrrn_order([small, big], now, 1_000_000.0))


def simulate(order: str, horizon_s: float = 10.0) -> tuple[float | None, int]:
    """A long job behind a steady stream of short ones (one every 4 ms from t=0) on a simulated clock.

    Each batch takes overhead + tokens / rate of simulated time. Returns (time the long job started or None,
    shorts served before it). `order` is "hrrn", "fifo" or "sjf" (shortest job first: sorted by tokens, then
    formed in that order).
    """
    rate, budget, period = 10_000.0, 1_000, 0.004
    long_job = job(2_000, 0.001, "long")
    queue = [job(10, 0.0, "short"), long_job]  # in arrival order
    next_arrival, t, served = period, 0.002, 0  # the device frees up just after the long job arrived
    while t < horizon_s:
        while next_arrival <= t:
            queue.append(job(10, next_arrival, "short"))
            next_arrival += period
        if order == "sjf":
            batch, queue = form_batch(sorted(queue, key=lambda j: j.tokens), budget, {}, "fifo", rate, now=t)
        else:
            batch, queue = form_batch(queue, budget, {}, order, rate, now=t)
        if long_job in batch:
            return t, served
        served += len(batch)
        t += BATCH_OVERHEAD_S + sum(j.tokens for j in batch) / rate
    return None, served


def test_a_long_job_ages_past_a_stream_of_short_ones():
    started, shorts_first = simulate("hrrn")
    assert started is not None, "HRRN never served the long job"
    assert started < 1.0 and shorts_first > 0, (started, shorts_first)  # shorts overtook it, then it aged past them
    # the same stream starves it under shortest-job-first, and FIFO serves it at once
    assert simulate("sjf")[0] is None
    assert simulate("fifo")[1] == 1  # only the short that arrived before it


def test_fifo_keeps_arrival_order():
    jobs = [job(t, a, f"j{i}") for i, (t, a) in enumerate([(500, 0.0), (5, 0.1), (50, 0.2)])]
    batch, rest = form_batch(jobs, 10_000, {}, "fifo", 3000.0, now=5.0)
    assert names(batch) == ["j0", "j1", "j2"] and rest == []


def test_batch_growth_counts_shared_prefixes_once():
    """Requests about one state share its tokens: the budget sees each shared token once."""
    template = list(range(1, 41))  # the cached template of "en": never counted
    state = list(range(500, 800))  # 300 tokens every request shares
    a = job(0, 0.0, "a", ids=template + state + [7, 8])
    b = job(0, 0.0, "b", ids=template + state + [9, 10])
    c = job(0, 0.0, "c", ids=template + list(range(900, 950)))
    for j in (a, b, c):  # a job's own packed size, template excluded (what the planner puts in Job.tokens)
        j.tokens -= len(template)
    prefixes = {"en": template}
    # a alone is 302; b adds 2 (its 300 shared tokens are already there); c adds 50
    batch, rest = form_batch([a, b, c], 304, prefixes, "fifo", 3000.0, now=1.0)
    assert names(batch) == ["a", "b"] and names(rest) == ["c"]
    batch, rest = form_batch([a, b, c], 354, prefixes, "fifo", 3000.0, now=1.0)
    assert names(batch) == ["a", "b", "c"] and rest == []
    batch, rest = form_batch([a, b, c], 303, prefixes, "fifo", 3000.0, now=1.0)
    assert names(batch) == ["a"] and names(rest) == ["b", "c"]


def test_an_oversized_job_runs_alone_and_budget_zero_means_one_job():
    big, small = job(5_000, 0.0, "big"), job(5, 0.0, "small")
    batch, rest = form_batch([big, small], 1_000, {}, "fifo", 3000.0, now=1.0)
    assert names(batch) == ["big"] and names(rest) == ["small"]
    # the long lane's budget: one request per batch, however small the others are
    queue = [job(5, 0.0, f"j{i}") for i in range(4)]
    batch, rest = form_batch(queue, 0, {}, "fifo", 3000.0, now=1.0)
    assert names(batch) == ["j0"] and names(rest) == ["j1", "j2", "j3"]


@pytest.mark.parametrize("schedule", ["hrrn", "fifo"])
def test_empty_queue(schedule):
    assert form_batch([], 100, {}, schedule, 3000.0, now=0.0) == ([], [])

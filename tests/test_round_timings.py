"""A request's planning, queue and compute times add up to at most its wall time, rounds included: its queue time
starts when planning ends, and a large choice's second round waits from when it was queued, not from the request's
arrival (which would count the first round again)."""

from __future__ import annotations

import time

from basal_local.api.systemone import validate_systemone

from .test_prefix_cache import M, make_engine


def test_queue_and_compute_of_every_round_fit_in_the_wall_time(tiny_model):
    engine = make_engine(tiny_model)
    big = {f"k{i}": f"Option number {i}" for i in range(13)}  # two rounds: the groups, then the finalists
    body = {"model": M, "state": "The parcel arrived late.",
            "questions": {"big": {"type": "choice", "instructions": "Pick one.", "criteria": big}}}
    try:
        for _ in range(4):
            request = validate_systemone(body, M)
            t = time.perf_counter()
            plan = engine.plan(request)
            assert plan.arrival - t >= plan.planning_s  # queued once planned (sizing included)
            outcome = engine.submit(plan).result(60)
            wall_ms = (time.perf_counter() - t) * 1000.0
            assert outcome.queue_ms > 0 and outcome.compute_ms > 0
            # planning, then the queue of each round, then its compute: no part counted twice
            parts = plan.planning_s * 1000.0 + outcome.queue_ms + outcome.compute_ms
            assert parts <= wall_ms, (plan.planning_s * 1000.0, outcome.queue_ms, outcome.compute_ms, wall_ms)
    finally:
        engine.stop(30)

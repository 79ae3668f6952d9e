"""A request's rounds leave no cyclic garbage: its futures, plan and outcome are freed by reference counting as
soon as their last user drops them, so serving never wakes the cycle collector for them (per-request cycles
made a daemon pause for a generation-1 collection every ~150 requests, ~3 ms each on the CPU)."""

from __future__ import annotations

import gc

from basal_local.api.systemone import validate_systemone

from .test_prefix_cache import M, make_engine


def test_a_request_leaves_no_cyclic_garbage(tiny_model):
    engine = make_engine(tiny_model)
    big = {f"k{i}": f"Option number {i}" for i in range(13)}  # a large choice: rounds after the first
    bodies = [{"model": M, "state": "The parcel arrived broken.",
               "questions": {"n": {"type": "noul", "instructions": "Is it urgent?"}}},
              {"model": M, "state": "The parcel arrived late.",
               "questions": {"big": {"type": "choice", "instructions": "Pick one.", "criteria": big}}}]
    try:
        for body in bodies:  # first use: caches, compiled paths, the telemetry's history fill up
            for _ in range(3):
                engine.submit(engine.plan(validate_systemone(body, M))).result(60)
        gc.collect()
        gc.set_debug(gc.DEBUG_SAVEALL)
        try:
            for body in bodies * 5:
                outcome = engine.submit(engine.plan(validate_systemone(body, M))).result(60)
                assert outcome.answers
            gc.collect()
            garbage = [type(o).__name__ for o in gc.garbage]
        finally:
            gc.set_debug(0)
            gc.garbage.clear()
        assert not garbage, sorted(set(garbage))
    finally:
        engine.stop(30)

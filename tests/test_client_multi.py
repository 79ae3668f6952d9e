"""basal-client's multi selection options against a live daemon: objectives, count bounds, exclusive labels and
the fallback, with the answer checked by brute force over the returned probabilities."""

from __future__ import annotations

import itertools
from importlib.util import find_spec

import numpy as np
import pytest

from .conftest import Daemon, http
from .test_multi_objective import _by_definition, _truths

pytestmark = pytest.mark.skipif(not find_spec("basal_client"), reason="basal-client is in the test extra")

LABELS = {"billing": "A billing problem", "delivery": "A delivery problem", "damage": "Damaged goods",
          "refund": "A refund request", "other": "Something else"}


@pytest.fixture(scope="module")
def served(tiny_model):
    d = Daemon(["--model", str(tiny_model), "--device", "cpu"])
    d.wait_ready(timeout=600)
    yield d
    d.stop()


def _best(objective, probabilities, allowed) -> float:
    keys = list(probabilities)
    p = [probabilities[k] for k in keys]
    ys, pr = _truths(p)
    best = -1.0
    for bits in itertools.product((0, 1), repeat=len(keys)):
        chosen = {keys[i] for i, b in enumerate(bits) if b}
        if allowed(chosen):
            best = max(best, _by_definition(objective, np.array(bits, dtype=float), ys, pr))
    return best


@pytest.mark.parametrize("objective", ["exact", "iou", "f1"])
def test_objectives_through_basal_client(served, objective):
    from basal_client import BasalClient, Questions, multi

    class Q(Questions):
        issues = multi("Which problems does the customer report?", LABELS, objective=objective, max=3,
                       exclusive=["other"])

    with BasalClient(served.url) as client:
        answer = client.decide("The parcel came late, the box was crushed and I was charged twice.", Q).answers.issues
    assert answer.objective == objective and answer.threshold is None
    probabilities = dict(answer.probabilities)
    selected = set(answer.selected)
    assert len(selected) <= 3 and ("other" not in selected or selected == {"other"})
    best = _best(objective, probabilities,
                 lambda s: len(s) <= 3 and ("other" not in s or len(s) == 1))
    keys = list(probabilities)
    ys, pr = _truths([probabilities[k] for k in keys])
    s = np.array([1.0 if k in selected else 0.0 for k in keys])
    assert _by_definition(objective, s, ys, pr) == pytest.approx(best, abs=1e-9)
    assert answer.expected_score == pytest.approx(best, abs=1e-9)
    assert answer.set_confidence == pytest.approx(_by_definition("exact", s, ys, pr), abs=1e-12)
    assert isinstance(answer.constraints_applied, list)


def test_fallback_through_basal_client(served):
    from basal_client import BasalClient, Questions, multi

    class Q(Questions):
        # a threshold no probability reaches: nothing passes, so the fallback is answered alone
        issues = multi("Which problems?", LABELS, threshold=1.0, fallback="other")

    with BasalClient(served.url) as client:
        answer = client.decide("Hello.", Q).answers.issues
    assert list(answer.selected) == ["other"] and "fallback" in answer.constraints_applied
    p = dict(answer.probabilities)
    expected = np.prod([p[k] if k == "other" else 1 - p[k] for k in p])
    assert answer.set_confidence == pytest.approx(expected)


def test_bad_selection_options_are_422s(served):
    bodies = {
        "objective": ({"objective": "jaccard"}, "objective must be one of threshold, exact, iou, f1, got jaccard"),
        "exclusive": ({"exclusive": ["nope"]}, "exclusive names an unknown label: nope"),
        "fallback": ({"fallback": "nope"}, "fallback must be one of the labels, got nope"),
        "threshold": ({"objective": "f1", "threshold": 0.3}, "threshold applies only to objective threshold, not f1"),
        "fallback_threshold": ({"fallback_threshold": 0.3}, "fallback_threshold requires fallback"),
    }
    for name, (extra, message) in bodies.items():
        body = {"state": "x", "questions": {"q": {"type": "multi", "instructions": "Which?",
                                                 "criteria": LABELS, **extra}}}
        status, _, got = http("POST", served.url + "/v1/basal", body)
        assert status == 422 and got == {"error": f"question 'q': {message}"}, (name, got)

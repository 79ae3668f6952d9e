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


TOOLS = [
    {"type": "function", "function": {"name": "refund", "description": "Refund the customer's payment",
                                      "parameters": {"type": "object"}}},
    {"name": "track_parcel", "description": "Look up where a parcel is", "inputSchema": {"type": "object"}},
    {"name": "escalate", "description": "Hand the case to a human agent " * 30, "input_schema": {"type": "object"}},
]


def test_tool_question_through_basal_client(served):
    from basal_client import BasalClient, Questions, tool

    class Q(Questions):
        route = tool("Which tool should handle this message?", TOOLS, rank=2)

    with BasalClient(served.url) as client:
        answer = client.decide("Where is my parcel? It is a week late.", Q).answers.route
    keys = ["refund", "track_parcel", "escalate", "answer_directly", "ask_user", "none"]
    assert list(answer.probabilities) == keys and sum(answer.probabilities.values()) == pytest.approx(1.0)
    best = max(keys, key=lambda k: answer.probabilities[k])
    assert answer.tool == best and answer.call == (best in keys[:3]) and not answer.deferred
    assert answer.confidence == pytest.approx(answer.probabilities[best])
    assert [r["tool"] for r in answer.ranking] == sorted(keys, key=lambda k: -answer.probabilities[k])[:2]


def test_multi_tool_question_through_basal_client(served):
    from basal_client import BasalClient, Questions, tool

    class Q(Questions):
        route = tool("Which tools are needed?", TOOLS, multi=True, objective="f1", extra=["none"],
                     exclusive=["none"])

    with BasalClient(served.url) as client:
        answer = client.decide("Refund me and tell me where the parcel is.", Q).answers.route
    assert answer.multi and set(answer.probabilities) == {"refund", "track_parcel", "escalate", "none"}
    chosen = set(answer.tools)
    assert "none" not in chosen or chosen == {"none"}
    assert answer.call == bool(chosen - {"none"})
    best = _best("f1", dict(answer.probabilities), lambda s: "none" not in s or len(s) == 1)
    assert answer.selection.expected_score == pytest.approx(best, abs=1e-9)


def test_tool_deferral_follows_the_certified_threshold(served):
    body = {"state": "Hello.", "questions": {"t": {"type": "tool", "instructions": "Which tool?", "tools": TOOLS,
                                                   "max_error": 0.01}}}
    status, _, got = http("POST", served.url + "/v1/basal", body)
    assert status == 200
    answer = got["answers"]["t"]
    # the generated model's CALIBRATION.json certifies max_error 0.01 at a confidence no random model reaches
    assert answer["deferred"] is True and answer["tool"] is None and answer["call"] is False
    body["questions"]["t"]["max_error"] = 0.123
    status, _, got = http("POST", served.url + "/v1/basal", body)
    assert got["answers"]["t"]["max_error"] == "no certified threshold for this target"
    assert got["answers"]["t"]["deferred"] is False and got["answers"]["t"]["tool"] is not None


def test_tool_descriptions_are_cut_at_a_word_boundary():
    from basal_local.protocol.tools import shorten, tool_options

    options, spec = tool_options({"tools": TOOLS}, "en")
    assert spec.tools == ("refund", "track_parcel", "escalate") and spec.extras == ("answer_directly", "ask_user", "none")
    cut = options["escalate"]
    assert len(cut) <= 300 and cut.endswith("…") and len(cut) > 250
    assert TOOLS[2]["description"].startswith(cut[:-1]) and TOOLS[2]["description"][len(cut) - 1] == " "
    assert options["refund"] == "Refund the customer's payment"
    assert shorten("abc def ghi", 8) == "abc def…" and shorten("abcdefghijkl", 5) == "abcd…" and shorten("abc", 0) == "abc"
    whole, _ = tool_options({"tools": TOOLS, "description_chars": 0}, "en")
    assert whole["escalate"] == TOOLS[2]["description"]


def test_bad_tool_questions_are_422s(served):
    cases = [
        ({"tools": []}, "tool needs a non-empty array of tool definitions in tools"),
        ({"tools": [{"description": "x"}]}, "tools[0] has no name"),
        ({"tools": [TOOLS[0], TOOLS[0]]}, "tools has two tools named refund"),
        ({"tools": TOOLS, "extra": ["maybe"]}, "extra must be an array of answer_directly, ask_user, none"),
        ({"tools": TOOLS, "rank": 0}, "rank must be a positive integer, got 0"),
        ({"tools": TOOLS, "objective": "f1"}, "objective is a selection option of multi tool questions (set multi: true)"),
        ({"tools": [{"name": "none"}]}, "a tool is named none, which is also a non-tool choice of extra"),
    ]
    for extra, message in cases:
        body = {"state": "x", "questions": {"t": {"type": "tool", "instructions": "Which?", **extra}}}
        status, _, got = http("POST", served.url + "/v1/basal", body)
        assert status == 422 and got == {"error": f"question 't': {message}"}, (extra, got)

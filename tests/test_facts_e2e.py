"""facts: "auto" over a real socket on both dialects: the model sees exactly the reference's injected state
(golden cases), and a state the reference refuses is the spec's 422 with the exception's text."""

from __future__ import annotations

import pytest

from .conftest import http
from .test_facts import golden

M = "basal-test-tiny"
QUESTIONS = {"n": {"type": "noul", "instructions": "Czy termin jest dotrzymany?"},
             "c": {"type": "choice", "criteria": ["tak", "nie", "nie wiadomo"]}}


@pytest.mark.parametrize("dialect", ["systemone", "basal"])
@pytest.mark.parametrize("case", [29, 93, 112, 151, 194])
def test_auto_facts_answer_as_the_golden_injected_state(daemon, dialect, case):
    """Asking with facts "auto" gives the same answers and input tokens as asking, without facts, about the
    reference's injected text itself (so the block reached the prompt byte for byte)."""
    g = golden(case)
    url = f"{daemon.url}/v1/{dialect}"
    status, _, auto = http("POST", url, {"model": M, "state": g["state"], "facts": "auto", "questions": QUESTIONS})
    assert status == 200, auto
    status, _, plain = http("POST", url, {"model": M, "state": g["injected"], "questions": QUESTIONS})
    assert status == 200, plain
    assert auto["answers"] == plain["answers"]
    assert auto["usage"]["input_tokens"] == plain["usage"]["input_tokens"]
    if g["injected"] != g["state"]:  # and the block changed the prompt
        status, _, bare = http("POST", url, {"model": M, "state": g["state"], "questions": QUESTIONS})
        assert bare["usage"]["input_tokens"] < auto["usage"]["input_tokens"]


@pytest.mark.parametrize("case, text", [
    (161, "[<class 'decimal.InvalidOperation'>]"), (54, "year 10000 is out of range"), (53, "date value out of range"),
])
def test_refused_states_are_the_exact_422(daemon, case, text):
    g = golden(case)
    assert g["error"].split(": ", 1)[1] == text
    body = {"model": M, "state": g["state"], "facts": "auto", "questions": QUESTIONS}
    status, _, out = http("POST", f"{daemon.url}/v1/systemone", body)
    assert status == 422 and out == {"detail": [
        {"type": "value_error", "loc": ["body", "state"], "msg": text, "input": g["state"]}]}
    status, _, out = http("POST", f"{daemon.url}/v1/basal", body)
    assert status == 422 and out == {"error": text}

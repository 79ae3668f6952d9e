"""Property tests over the request space and raw bytes, both endpoints, over a real socket.

Every answer is a 200 with answers for every question, or a well-formed 4xx in the dialect's shape; never a
5xx, never a hang (every exchange has a deadline); and the daemon keeps serving afterwards.
"""

from __future__ import annotations

import json

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from . import rawhttp, test_reliability
from .test_reliability import PATHS, SMALL, assert_dialect_error

d = test_reliability.d  # the session fixture: one daemon for both files

M = "basal-test-tiny"
PROPERTY_SETTINGS = settings(max_examples=120, deadline=None, derandomize=True,
                             suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])

scalars = st.none() | st.booleans() | st.integers(-10**30, 10**30) | st.floats(allow_nan=False) | st.text(max_size=20)
json_values = st.recursive(scalars, lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=8), c,
                                                                                      max_size=4), max_leaves=12)
texts = st.text(max_size=40) | json_values
question = st.fixed_dictionaries(
    {},
    optional={
        "type": st.sampled_from(["choice", "noul", "score", "multi", "act", "rank", "", None, 5, ["choice"]]),
        "instructions": texts,
        "criteria": json_values | st.lists(st.text(max_size=6), max_size=12)
        | st.dictionaries(st.text(max_size=6), st.none() | texts, max_size=12),
        "levels": st.lists(texts, max_size=12),
        "option_keys": st.sampled_from(["show", "hide", "maybe", None, 1]),
        "evidence": st.booleans(),
    })
request = st.fixed_dictionaries(
    {},
    optional={
        "model": st.sampled_from([M, "nope-1", 7, None, ""]),
        "state": texts,
        "questions": st.dictionaries(st.text(max_size=6), question, max_size=4) | json_values,
        "facts": st.sampled_from(["off", "auto", "on", None]),
    })


def check(path: str, status: int, body, sent) -> None:
    assert status < 500, (status, body, sent)
    if status == 200:
        assert set(body) >= {"model", "answers", "usage"}
        assert isinstance(sent, dict) and set(body["answers"]) == set(sent["questions"])
    else:
        assert_dialect_error(path, status, body)


@PROPERTY_SETTINGS
@given(body=request, path=st.sampled_from(PATHS))
def test_any_request_is_answered_or_a_well_formed_4xx(d, body, path):
    status, _, answer = rawhttp.post(d.port, path, json.dumps(body).encode(), deadline_s=60)
    check(path, status, answer, body)


def _mutate(data: bytes, edits: list[tuple[int, int, bytes]]) -> bytes:
    out = bytearray(data)
    for pos, cut, insert in edits:
        at = pos % (len(out) + 1)
        out[at: at + cut] = insert
    return bytes(out)


raw_bodies = st.binary(max_size=300) | st.builds(
    _mutate, st.just(json.dumps(SMALL).encode()),
    st.lists(st.tuples(st.integers(0, 200), st.integers(0, 4), st.binary(max_size=4)), min_size=1, max_size=4))


@PROPERTY_SETTINGS
@given(data=raw_bodies, path=st.sampled_from(PATHS),
       encoding=st.sampled_from([None, None, "gzip", "zstd", "identity", "x-bogus"]))
def test_any_bytes_are_answered_or_a_well_formed_4xx(d, data, path, encoding):
    headers = {"content-encoding": encoding} if encoding else {}
    status, _, answer = rawhttp.post(d.port, path, data, headers, deadline_s=60)
    try:
        sent = json.loads(data)
    except ValueError:
        sent = None
    check(path, status, answer, sent)


def test_the_daemon_still_serves_and_logged_no_traceback(d):
    assert rawhttp.post(d.port, "/v1/systemone", SMALL)[0] == 200
    assert not any("Traceback" in line for line in d.lines), d.lines

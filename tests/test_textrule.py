"""The JSON text rule (docs/PROTOCOL.md §4.3) against Python's own json.dumps, and what must be rejected."""

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from basal_local.protocol.textrule import JsonSyntaxError, parse_json, to_text

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(min_value=-10**30, max_value=10**30)
    | st.floats(allow_nan=False, allow_infinity=False) | st.text(),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=5), children, max_size=4),
    max_leaves=12,
)


@settings(max_examples=300, deadline=None)
@given(json_values)
def test_text_rule_matches_python_json_dumps(value):
    wire = json.dumps(value)  # what a client sends (ASCII escapes)
    parsed = parse_json(wire.encode())
    expected = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)
    assert to_text(parsed) == expected


@pytest.mark.parametrize("literal, text", [
    ("-3e-07", "-3e-07"), ("1e16", "1e+16"), ("100.0", "100.0"), ("0.0001", "0.0001"), ("1E5", "100000.0"),
    ("-0", "0"), ("12345678901234567890123", "12345678901234567890123"), ("2.50", "2.5"), ("1e-5", "1e-05"),
])
def test_number_literals(literal, text):
    assert to_text(parse_json(f"[{literal}]")) == f"[{text}]"


def test_strings_raw_and_escaped():
    value = parse_json(r'{"a": "ż🙁\u007f\t\n\"\\\u0001", "a": 2, "b": null}')
    # duplicate key: last value, first position; controls escaped lowercase, non-ASCII raw
    assert to_text(value) == '{"a": 2, "b": null}'
    assert to_text(parse_json(r'["ż🙁\u007f\t\u0001"]')) == '["ż🙁\x7f\\t\\u0001"]'


@pytest.mark.parametrize("body, pos", [
    ('{"a": NaN}', 6), ('{"a": Infinity}', 6), ('[1, -Infinity]', 4), ('{"a": 1e400}', 6),
    ('["ok", "\\ud800"]', 8), ('{"\\udc00x": 1}', 2),
])
def test_rejected_literals(body, pos):
    with pytest.raises(JsonSyntaxError) as err:
        parse_json(body)
    assert err.value.pos == pos


def test_surrogate_pair_is_fine():
    assert parse_json('["\\ud83d\\ude41"]') == ["🙁"]


def test_decoder_message_and_offset():
    with pytest.raises(JsonSyntaxError) as err:
        parse_json('{"a": 1,}')
    assert (err.value.msg, err.value.pos) == ("Expecting property name enclosed in double quotes", 8)

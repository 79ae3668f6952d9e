"""JSON parsing and the Python-compatible text rule (PROTOCOL.md §4.3).

Python's own `json` gives exactly the text the models were trained on (`json.dumps(ensure_ascii=False)`,
float repr, literal int digits, duplicate keys: last value at the first position). What it accepts but
the contract forbids is rejected here: NaN/Infinity literals, numbers that overflow a double, and lone
surrogates.
"""

from __future__ import annotations

import json
import re
from typing import Any

# A JSON string token, or a number, or a bare word: used to find where a rejected literal sits.
_TOKEN = re.compile(r'"(?:[^"\\]|\\.)*"|(-?Infinity|NaN)|(-?\d+(?:\.\d+)?[eE][-+]?\d+)')
_SURROGATE = re.compile(r"[\ud800-\udfff]")


class JsonSyntaxError(ValueError):
    """Not valid JSON for this contract; `msg`, `pos` (character offset) and the text as Python's decoder gives."""

    def __init__(self, msg: str, pos: int, text: str = "") -> None:
        line = text.count("\n", 0, pos) + 1
        column = pos - text.rfind("\n", 0, pos)
        super().__init__(f"{msg}: line {line} column {column} (char {pos})")
        self.msg = msg
        self.pos = pos


class _Rejected(Exception):
    pass


def _reject_constant(_name: str) -> Any:
    raise _Rejected


def _parse_float(literal: str) -> float:
    value = float(literal)
    if value in (float("inf"), float("-inf")):
        raise _Rejected
    return value


def _first_bad_literal(text: str) -> int:
    for match in _TOKEN.finditer(text):
        if match.group(1):
            return match.start(1)
        if match.group(2) and float(match.group(2)) in (float("inf"), float("-inf")):
            return match.start(2)
    return 0


def _has_lone_surrogate(value: Any) -> bool:
    if isinstance(value, str):
        return _SURROGATE.search(value) is not None
    if isinstance(value, dict):
        return any(_has_lone_surrogate(k) or _has_lone_surrogate(v) for k, v in value.items())
    if isinstance(value, list):
        return any(_has_lone_surrogate(v) for v in value)
    return False


def parse_json(data: bytes | str) -> Any:
    """Parse a request body. Raises JsonSyntaxError(msg, pos) like Python's decoder does."""
    if isinstance(data, bytes):
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise JsonSyntaxError("Invalid UTF-8 in request body", exc.start) from None
    else:
        text = data
    if text.startswith("\ufeff"):
        raise JsonSyntaxError("Unexpected UTF-8 BOM (decode using utf-8-sig)", 0, text)
    try:
        value = json.loads(text, parse_constant=_reject_constant, parse_float=_parse_float)
    except json.JSONDecodeError as exc:
        raise JsonSyntaxError(exc.msg, exc.pos, text) from None
    except _Rejected:
        raise JsonSyntaxError("Expecting value", _first_bad_literal(text), text) from None
    if _has_lone_surrogate(value):
        match = re.search(r"\\u[dD][89a-fA-F][0-9a-fA-F]{2}", text)
        raise JsonSyntaxError("Lone surrogate in string", match.start() if match else 0, text)
    return value


def to_text(value: Any) -> str:
    """The text rule: strings verbatim, anything else as Python `json.dumps(ensure_ascii=False)`."""
    if isinstance(value, str):
        return value
    return json.dumps(value, ensure_ascii=False)


def is_text_value(value: Any) -> bool:
    """state / instructions / descriptions must be a string, an object or an array."""
    return isinstance(value, (str, dict, list))

"""JSON parsing and the Python-compatible text rule (docs/PROTOCOL.md §4.3).

Python's own `json` gives exactly the text the models were trained on (`json.dumps(ensure_ascii=False)`,
float repr, literal int digits, duplicate keys: last value at the first position). What it accepts but
the contract forbids is rejected here: NaN/Infinity literals, numbers that overflow a double, lone
surrogates, integers of more than 4,300 digits and nesting deeper than 128 levels.
"""

from __future__ import annotations

import json
import re
from typing import Any

# A JSON string token, or a number, or a bare word: used to find where a rejected literal sits.
_TOKEN = re.compile(r'"(?:[^"\\]|\\.)*"|(-?Infinity|NaN)|(-?\d+(?:\.\d+)?[eE][-+]?\d+)')
_BRACKET = re.compile(r'"(?:[^"\\]|\\.)*"|([\[\]{}])')
# Deeper documents are refused (serde_json's limit, which basal-rs has): no request needs them, and walking
# them recursively (parser, text rule, validation) would exhaust the stack.
MAX_DEPTH = 128
TOO_DEEP = f"Nesting deeper than {MAX_DEPTH} levels"
# Python refuses to convert longer integer literals (sys.get_int_max_str_digits), so no text rule could show them.
MAX_INT_DIGITS = 4300


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


def has_surrogate(text: str) -> bool:
    """A lone surrogate cannot be encoded as UTF-8 (a regex scan is ~100x slower on big strings)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def _check_tree(value: Any, text: str) -> None:
    """Depth and lone surrogates, walked with an explicit stack (a deep body must not recurse here)."""
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, str):
            if not item.isascii() and has_surrogate(item):
                match = re.search(r"\\u[dD][89a-fA-F][0-9a-fA-F]{2}", text)
                raise JsonSyntaxError("Lone surrogate in string", match.start() if match else 0, text)
        elif isinstance(item, dict):
            if depth > MAX_DEPTH:
                raise _too_deep(text)
            stack.extend((k, depth) for k in item)
            stack.extend((v, depth + 1) for v in item.values())
        elif isinstance(item, list):
            if depth > MAX_DEPTH:
                raise _too_deep(text)
            stack.extend((v, depth + 1) for v in item)


def _too_deep(text: str) -> JsonSyntaxError:
    """The error at the bracket that opens level MAX_DEPTH + 1 (strings skipped)."""
    depth = 0
    for match in _BRACKET.finditer(text):
        bracket = match.group(1)
        if bracket in ("[", "{"):
            depth += 1
            if depth > MAX_DEPTH:
                return JsonSyntaxError(TOO_DEEP, match.start(1), text)
        elif bracket:
            depth -= 1
    return JsonSyntaxError(TOO_DEEP, 0, text)


def _too_big_int(text: str) -> JsonSyntaxError:
    match = re.search(rf"\d{{{MAX_INT_DIGITS + 1},}}", text)
    return JsonSyntaxError(f"Integer with more than {MAX_INT_DIGITS} digits", match.start() if match else 0, text)


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
    except RecursionError:
        raise _too_deep(text) from None
    except ValueError:  # "Exceeds the limit (4300 digits) for integer string conversion"
        raise _too_big_int(text) from None
    _check_tree(value, text)
    return value


def to_text(value: Any) -> str:
    """The text rule: strings verbatim, anything else as Python `json.dumps(ensure_ascii=False)`."""
    if isinstance(value, str):
        return value
    return json.dumps(value, ensure_ascii=False)


def is_text_value(value: Any) -> bool:
    """state / instructions / descriptions must be a string, an object or an array."""
    return isinstance(value, (str, dict, list))

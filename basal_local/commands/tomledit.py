"""Edit one key of a config.toml in place, keeping every other line (comments, order, blank lines) as it is.

Python reads TOML (`tomllib`) but cannot write it, and the settings' values are simple (numbers, booleans, text,
lists of text, and the two tables `[aliases]` and `[placement]`), so a line editor does: it finds a key's lines
(a value may span several: they end where the text parses), replaces or removes them, and the caller parses the
result again before it is written.
"""

from __future__ import annotations

import json
import re
import tomllib
from typing import Any

_KEY = re.compile(r'\s*("(?:[^"\\]|\\.)*"|[A-Za-z0-9_-]+)\s*=')
_BARE = re.compile(r"[A-Za-z0-9_-]+")


def toml_value(value: Any) -> str:
    """A value as TOML text (JSON's string escapes are TOML's)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value, ensure_ascii=False)
    if isinstance(value, list):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{toml_key(k)} = {toml_value(v)}" for k, v in value.items()) + "}"
    raise TypeError(f"no TOML form for {type(value).__name__}")


def toml_key(key: str) -> str:
    return key if _BARE.fullmatch(key) else json.dumps(key, ensure_ascii=False)


def _parses(text: str) -> bool:
    try:
        tomllib.loads(text)
    except tomllib.TOMLDecodeError:
        return False
    return True


def _entries(lines: list[str]) -> tuple[list[tuple[str | None, str, int, int]], list[tuple[str, int]]]:
    """(section, key, first line, end line) of every key, and (section, line) of every table header."""
    entries, headers = [], []
    section: str | None = None
    i = 0
    while i < len(lines):
        stripped = lines[i].strip()
        if stripped.startswith("["):
            section = stripped.strip("[]").split("#")[0].strip().strip("[] ").strip('"')
            headers.append((section, i))
            i += 1
            continue
        found = _KEY.match(lines[i])
        if not found:
            i += 1
            continue
        key = found.group(1)
        key = json.loads(key) if key.startswith('"') else key
        end = i + 1
        while end < len(lines) and not _parses("".join(lines[i:end])):
            end += 1  # a value over several lines ends where it parses
        entries.append((section, key, i, end))
        i = end
    return entries, headers


def set_key(text: str, key: str, value: Any, table: str | None = None) -> str:
    """`text` with `key = value` at the top level (or in `[table]`), replacing the key's old lines."""
    lines = text.splitlines(keepends=True)
    if lines and not lines[-1].endswith("\n"):
        lines[-1] += "\n"
    entries, headers = _entries(lines)
    line = f"{toml_key(key)} = {toml_value(value)}\n"
    for section, name, start, end in entries:
        if section == table and name == key:
            return "".join(lines[:start] + [line] + lines[end:])
    if table is None:
        own = [end for section, _, _, end in entries if section is None]
        if own:
            at = own[-1]
        elif headers:
            at = headers[0][1]
            while at > 0 and lines[at - 1].lstrip().startswith("#"):
                at -= 1  # a header's own comment stays above it
        else:
            at = len(lines)
        extra = ["\n"] if not own and headers else []
        return "".join(lines[:at] + [line] + extra + lines[at:])
    starts = [i for section, i in headers if section == table]
    if starts:
        inside = [end for section, _, _, end in entries if section == table]
        at = inside[-1] if inside else starts[0] + 1
        return "".join(lines[:at] + [line] + lines[at:])
    gap = ["\n"] if lines and lines[-1].strip() else []
    return "".join(lines + gap + [f"[{toml_key(table)}]\n", line])


def remove_key(text: str, key: str, table: str | None = None) -> tuple[str, bool]:
    """`text` without `key` (at the top level or in `[table]`); `table` alone with key "" drops the whole table.
    Returns the text and whether anything was removed."""
    lines = text.splitlines(keepends=True)
    entries, headers = _entries(lines)
    if table is not None and key == "":
        starts = [i for section, i in headers if section == table]
        if not starts:
            return text, False
        start = starts[0]
        later = [i for _, i in headers if i > start]
        end = later[0] if later else len(lines)
        while start > 0 and not lines[start - 1].strip():
            start -= 1  # and the blank lines that set it apart
        return "".join(lines[:start] + (["\n"] if start and end < len(lines) else []) + lines[end:]), True
    for section, name, start, end in entries:
        if section == table and name == key:
            return "".join(lines[:start] + lines[end:]), True
    return text, False

"""How one setting is declared and checked: `setting(...)` on a field of a settings dataclass (settings.py declares
them all) puts a `Spec` in the field's metadata: type, range, `config.toml` key, CLI flag and `--help` text;
`declared(cls)` lists a dataclass's settings; `check` validates a value by type and range wherever it came from
(a flag, a variable, config.toml), with a sentence saying what is allowed; `range_text` is that sentence's end.
"""

from __future__ import annotations

import math
import re
from dataclasses import MISSING, dataclass, field, fields
from typing import Any

from .backends.memory import parse_limit


@dataclass(frozen=True)
class Spec:
    """What a field's declaration says beyond its default."""

    help: str
    kind: type  # int, float, bool, str, list (of str), dict
    flag: str | None = None  # None: config.toml only
    dest: str | None = None  # the argparse dest when it is not the key
    minimum: float | None = None
    maximum: float | None = None
    above: float | None = None  # an exclusive lower bound
    choices: tuple[str, ...] | None = None
    env: str | None = None  # also read from this environment variable
    optional: bool = False  # None is allowed (unset)
    action: str | None = None  # argparse: store_true, negate (--no-X stores False), boolean (--X/--no-X), append
    metavar: str | None = None
    show_default: bool = True
    number_ok: bool = False  # a str setting that config.toml may also give as a number (gpu_memory = 0.8)
    flag_zero: bool = False  # the flag also takes 0 (the port: the system picks one; the command handles it)
    validate: str | None = None  # a further check by name (VALIDATORS): the form of a size, say
    items: tuple[str, ...] | None = None  # a list setting: the names its items may be
    comma: bool = False  # a list setting whose text (flag, config string) is a comma list: "gate_up,down"
    group: str | None = None  # flags that `-h` lists under a heading of their own (GROUPS); `bench` takes "torch"
    duration: bool = False  # a float of seconds that text may give as 10m, 1h30m, 45s or forever (parse_keep_alive)


def setting(default: Any, help: str, kind: type | None = None, **spec: Any) -> Any:
    """A dataclass field declaring one setting (see Spec for the keywords)."""
    kind = kind or type(default)
    meta = {"setting": Spec(help, kind, **spec)}
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: type(default)(default), metadata=meta)
    return field(default=default, metadata=meta)


def range_text(spec: Spec) -> str:
    if spec.items:
        return "a comma list of " + ", ".join(spec.items)
    if spec.choices:
        return "one of " + ", ".join(spec.choices)
    if spec.duration:
        return "a duration such as 10m, 1h, 600 (seconds) or forever"
    if spec.kind is str and spec.metavar and "|" in spec.metavar:  # --prefix-cache's SIZE|SHARE|auto|off
        return "one of " + spec.metavar.replace("|", ", ")
    noun = {int: "a whole number", float: "a number", bool: "true or false", str: "text",
            list: "a list of names", dict: "a table"}[spec.kind]
    if spec.above is not None:
        return f"{noun} above {spec.above:g}"
    if spec.minimum is not None and spec.maximum is not None:
        return f"{noun} from {spec.minimum:g} to {spec.maximum:g}"
    if spec.minimum is not None:
        return f"{noun} of at least {spec.minimum:g}"
    return noun


def check(key: str, spec: Spec, value: Any, from_text: bool = False) -> Any:
    """The value as the field's type, or ValueError with a sentence saying what is allowed. `from_text`: the value
    is a flag's or a variable's text (config.toml values keep their TOML type)."""
    wanted = range_text(spec)
    if value is None and spec.optional:
        return None
    kind = spec.kind
    try:
        if kind is bool:
            if from_text and isinstance(value, str) and value.lower() in ("1", "true", "yes", "0", "false", "no"):
                value = value.lower() in ("1", "true", "yes")
            if not isinstance(value, bool):
                raise TypeError
        elif kind is int:
            if from_text and isinstance(value, str):
                value = int(value)
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError
        elif kind is float:
            if spec.duration and isinstance(value, str):
                value = parse_keep_alive(value)
                if value is None:  # forever
                    return None
            if from_text and isinstance(value, str):
                value = float(value)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise TypeError
            value = float(value)
        elif kind is str:
            numeric = spec.number_ok and isinstance(value, (int, float)) and not isinstance(value, bool)
            if not numeric and not isinstance(value, str):  # (a number still goes through the validator)
                raise TypeError
        elif kind is list:
            if isinstance(value, str):
                value = [p.strip() for p in value.split(",") if p.strip()] if spec.comma else [value]
            if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
                raise TypeError
            if spec.items is not None and not set(value) <= set(spec.items):
                raise ValueError
        elif kind is dict:
            if not isinstance(value, dict):
                raise TypeError
    except (TypeError, ValueError):
        raise ValueError(f"{key} = {_shown(value)}: must be {wanted}") from None
    if spec.validate is not None:
        try:
            VALIDATORS[spec.validate](value)
        except ValueError as exc:
            raise ValueError(f"{key} = {_shown(value)}: {exc}") from None
    bad = (spec.choices is not None and value not in spec.choices
           or spec.minimum is not None and value < spec.minimum
           or spec.maximum is not None and value > spec.maximum
           or spec.above is not None and value <= spec.above)
    if bad:
        raise ValueError(f"{key} = {_shown(value)}: must be {wanted}")
    return value


def _shown(value: Any) -> str:
    """A value as its user wrote it in config.toml (true, not Python's True)."""
    return str(value).lower() if isinstance(value, bool) else repr(value)


def _cache_size(value: Any) -> None:
    if str(value).strip().lower() not in ("auto", "off"):
        parse_limit(str(value), flag="--prefix-cache")


VALIDATORS = {"prefix_cache": _cache_size}


def declared(cls: type) -> list[tuple[str, Spec, Any]]:
    """(key, spec, default) of every setting a settings dataclass declares, in declaration order."""
    out = []
    for f in fields(cls):
        spec = f.metadata.get("setting")
        if spec is None:
            continue
        default = f.default if f.default is not MISSING else f.default_factory()  # type: ignore[misc]
        out.append((f.name, spec, default))
    return out


def parse_keep_alive(value: Any) -> float | None:
    """`10m`, `1h30m`, `45s`, `600` (seconds), 0 (unload once idle), `forever`/-1/None (never): seconds or None."""
    if value is None or value == -1 or value in ("forever", "-1", "inf"):
        return None
    if isinstance(value, bool):
        raise ValueError("keep_alive must be a duration such as 10m, 600 or forever")
    if isinstance(value, (int, float)):
        if value != value:
            raise ValueError("keep_alive must be a duration such as 10m, 600 or forever, not NaN")
        if value < 0:
            raise ValueError("keep_alive must be at least 0 (or forever)")
        return None if value == float("inf") else float(value)  # infinity: forever (answers stay valid JSON)
    text = str(value).strip().lower()
    try:
        return parse_keep_alive(float(text))
    except ValueError:
        pass
    parts = re.fullmatch(r"(?:(\d+(?:\.\d+)?)h)?(?:(\d+(?:\.\d+)?)m)?(?:(\d+(?:\.\d+)?)s)?", text)
    if not text or not parts:
        raise ValueError(f"keep_alive {value!r} is not a duration (e.g. 10m, 1h, 90s, 600 or forever)")
    h, m, s = (float(p or 0) for p in parts.groups())
    return h * 3600 + m * 60 + s

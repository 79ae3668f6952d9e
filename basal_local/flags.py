"""The command line side of the declarations: `add_flags` builds the `serve` flags (and `bench`'s "torch" group,
`config`'s copy) from every setting that declares one, each help ending in the declared default; `flag_overrides`
reads the given ones back as settings for `Settings.load`.
"""

from __future__ import annotations

import argparse
from typing import Any

from .declare import VALIDATORS, Spec, check, range_text
from .settings import all_settings


def _flag_type(key: str, spec: Spec):
    def parse(text: str) -> Any:
        if spec.flag_zero and text.strip() == "0":
            return 0
        try:
            if spec.validate is not None:  # its own sentence names the flag and the accepted forms
                VALIDATORS[spec.validate](text)
            return check(spec.flag or key, spec, text, from_text=True)
        except ValueError as exc:
            zero = " (or 0: a free one)" if spec.flag_zero else ""
            raise argparse.ArgumentTypeError(str(exc) if spec.validate else
                                             f"{text} must be {range_text(spec)}{zero}") from None

    parse.__name__ = spec.kind.__name__  # argparse names the type in its own messages
    return parse


GROUPS = {"torch": "torch backend (CUDA)"}  # the headings of the flag groups in `-h`


def shown_default(default: Any) -> str:
    """A default as `--help` shows it."""
    if isinstance(default, bool):
        return "on" if default else "off"
    if isinstance(default, float):
        return f"{default:g}"
    return ",".join(default) if isinstance(default, list) else str(default)


def add_flags(parser, group: str | None = None, headings: bool = True) -> None:
    """Every declared setting that has a flag (only those of `group` when it is given), with its declared help and
    default; a grouped flag under its group's heading (`headings=False`: `parser` is itself a group, and groups
    do not nest)."""
    headings = {name: parser.add_argument_group(title) for name, title in GROUPS.items()
                if group in (None, name)} if headings else {}
    for key, spec, default, _ in all_settings():
        if spec.flag is None or group is not None and spec.group != group:
            continue
        shown = shown_default(default)
        text = spec.help + (f" (default {shown})" if spec.show_default else "") + \
            (f"; also {spec.env}" if spec.env else "")
        dest = spec.dest or key
        target = headings.get(spec.group, parser) if spec.group else parser
        if spec.action == "store_true":
            target.add_argument(spec.flag, action="store_true", dest=dest, default=None, help=text)
        elif spec.action == "negate":
            target.add_argument(spec.flag, action="store_false", dest=dest, default=None, help=text)
        elif spec.action == "boolean":
            target.add_argument(spec.flag, action=argparse.BooleanOptionalAction, dest=dest, default=None, help=text)
        elif spec.action == "append":
            target.add_argument(spec.flag, action="append", dest=dest, metavar=spec.metavar, help=text)
        elif spec.choices:
            target.add_argument(spec.flag, dest=dest, choices=spec.choices, metavar=spec.metavar, help=text)
        else:
            target.add_argument(spec.flag, dest=dest, type=_flag_type(key, spec), metavar=spec.metavar, help=text)


def flag_overrides(args: argparse.Namespace, group: str | None = None) -> dict[str, Any]:
    """The settings given as flags in `args` (absent or unset flags left out; only `group`'s when it is given)."""
    out = {}
    for key, spec, _, _ in all_settings():
        if spec.flag is not None and (group is None or spec.group == group):
            value = getattr(args, spec.dest or key, None)
            if value is not None:
                out[key] = value
    return out

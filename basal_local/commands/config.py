"""`basal-local config`: the effective settings and where each came from, and config.toml edited with the checks
of their declarations (basal_local/settings.py).

    basal-local config [show] [--json] [serve flags]   every setting: value, and default / config.toml / env / flag
    basal-local config path                            where config.toml is (and whether it exists)
    basal-local config get KEY                         one effective value, for scripts
    basal-local config set KEY VALUE                   write it to config.toml (checked first; aliases.NAME too)
    basal-local config unset KEY                       remove it from config.toml (back to the default)
    basal-local config keys [--json]                   every key: type and range, default, flag, variable, help
    basal-local config validate                        check config.toml and the environment as `serve` would
"""

from __future__ import annotations

import argparse
import difflib
import json
import os
import tomllib
from pathlib import Path
from typing import Any

from ..declare import check, range_text
from ..flags import flag_overrides
from ..settings import Settings, all_settings, config_path, file_values
from . import UserError
from .tomledit import remove_key, set_key

SECRET = {"api_key"}
TABLES = {"aliases", "placement"}  # dict settings: config set aliases.NAME VALUE


def _specs() -> dict[str, Any]:
    return {key: spec for key, spec, _, _ in all_settings()}


def _path(args: argparse.Namespace) -> Path:
    path = Path(args.config).expanduser() if getattr(args, "config", None) else config_path()
    if path.is_dir():  # a folder is no config file (read as none, or refused as unreadable, before)
        raise UserError(f"{'--config ' if getattr(args, 'config', None) else ''}{path} is a folder, not a config "
                        "file", "name the file, e.g. --config ~/.config/basal-local/config.toml")
    return path


def _read(path: Path) -> tuple[str, dict[str, Any]]:
    """The file's text and parsed values ("" and {} when there is no file)."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return "", {}
    except (OSError, UnicodeDecodeError) as exc:
        raise UserError(f"cannot read {path} ({exc.__class__.__name__})", "check its permissions") from None
    try:
        return text, tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise UserError(f"{path}: not valid TOML ({exc})", "fix it by hand, or remove the file") from None


def _unknown_key(key: str) -> UserError:
    known = list(_specs())
    near = difflib.get_close_matches(key.split(".")[0], known, n=1)
    hint = f"did you mean {near[0]!r}? " if near else ""
    return UserError(f"unknown setting {key!r}", f"{hint}`basal-local config keys` lists them all")


def _shown(key: str, value: Any) -> str:
    if value is None or (key in SECRET and not value):
        return "(unset)"
    if key in SECRET:
        return "(set, hidden)"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return f"{value:g}"
    if isinstance(value, list):
        return ", ".join(value) if value else "(none)"
    if isinstance(value, dict):
        return ", ".join(f"{k} = {v}" for k, v in value.items()) if value else "(none)"
    return str(value)


def effective(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Each setting: key, value, default, and where the value came from (flag > env > config.toml > default)."""
    path = _path(args)
    flags = flag_overrides(args)
    # `--port 0` is serve's own (it binds a free port before the settings are read): shown as given
    zero = {k for k, v in flags.items() if v == 0 and _specs()[k].flag_zero}
    try:
        settings = Settings.load({k: v for k, v in flags.items() if k not in zero}, path)
        in_file = file_values(path)
    except (ValueError, OSError) as exc:
        raise UserError(str(exc), "fix the value where it is given (`basal-local config keys` says what each "
                        "setting takes)") from None
    rows = []
    for key, spec, default, engine in all_settings():
        value = 0 if key in zero else getattr(settings.engine if engine else settings, key)
        if key in flags:
            source = f"flag {spec.flag}"
        elif spec.env and os.environ.get(spec.env):
            source = f"env {spec.env}"
        elif key in in_file:
            source = "config.toml"
        else:
            source = "default"
        rows.append({"key": key, "value": value, "default": default, "source": source, "engine": engine})
    return rows


def show(args: argparse.Namespace) -> int:
    path = _path(args)
    rows = effective(args)
    if args.json:
        out = [{**r, "value": "(hidden)" if r["key"] in SECRET and r["value"] else r["value"]} for r in rows]
        print(json.dumps({"config_file": str(path), "exists": path.is_file(), "settings": out}, indent=1))
        return 0
    print(f"config file: {path}" + ("" if path.is_file() else "  (not there: every value is a default, a variable "
                                                                "or a flag)"))
    width = max(len(r["key"]) for r in rows)
    values = [_shown(r["key"], r["value"]) for r in rows]
    vwidth = min(40, max(len(v) for v in values))
    print(f"{'KEY':<{width}}  {'VALUE':<{vwidth}}  FROM")
    for r, v in zip(rows, values):
        print(f"{r['key']:<{width}}  {v:<{vwidth}}  {r['source']}")
    return 0


def get(args: argparse.Namespace) -> int:
    key = _need(args.key, "get")
    if key not in _specs():
        raise _unknown_key(key)
    (row,) = [r for r in effective(args) if r["key"] == key]
    value = row["value"]
    if isinstance(value, (list, dict)):
        print(json.dumps(value, ensure_ascii=False))
    elif value is not None:
        print(_shown("", value))  # scripts read the key itself, hidden or not
    return 0


def _need(value: str | None, action: str, what: str = "KEY") -> str:
    if not value:
        example = {"get": "get port", "set": "set port 8001", "unset": "unset port"}[action]
        raise UserError(f"config {action} needs {what}", f"e.g. basal-local config {example}")
    return value


def parse_value(key: str, text: str) -> Any:
    """A command-line VALUE as the setting's type, checked against its declaration."""
    spec = _specs()[key]
    if spec.kind is list:
        value: Any = [part.strip() for part in text.split(",") if part.strip()]
    else:
        value = text
    try:
        return check(key, spec, value, from_text=True)
    except ValueError as exc:
        raise UserError(str(exc), f"`basal-local config keys` says what {key} takes") from None


def _write(path: Path, text: str) -> None:
    """Check the new text as `serve` would read it, then replace the file in one step."""
    try:
        file_values(path, tomllib.loads(text))
    except (ValueError, tomllib.TOMLDecodeError) as exc:
        raise UserError(f"not written: {exc}", f"edit {path} by hand") from None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, path)
    except OSError as exc:
        raise UserError(f"cannot write {path} ({exc.strerror or exc})", "check the folder's permissions") from None


def _split(key: str) -> tuple[str, str | None]:
    """`aliases.NAME` -> ("aliases", "NAME"); a plain key -> (key, None)."""
    base, dot, name = key.partition(".")
    if base not in _specs():
        raise _unknown_key(key)
    if base in TABLES:
        if dot and name:
            return base, name
        return base, None
    if dot:
        raise UserError(f"{base} is not a table: {key!r}", f"e.g. basal-local config set {base} VALUE")
    return base, None


def set_(args: argparse.Namespace) -> int:
    key = _need(args.key, "set")
    base, name = _split(key)
    if args.value is None:
        raise UserError(f"config set {key} needs a VALUE", f"e.g. basal-local config set {key} "
                        + ("mini" if base in TABLES else str(_example(base))))
    path = _path(args)
    text, data = _read(path)
    if base in TABLES:
        if name is None:
            raise UserError(f"{base} is a table of names", f"set one entry: basal-local config set {base}.NAME VALUE")
        entry: Any = args.value
        if base == "placement":
            entry = [d.strip() for d in args.value.split(",") if d.strip()]
        if isinstance(data.get(base), dict) and not text_has_table(text, base):
            text = set_key(text, base, {**data[base], name: entry})  # an inline table stays inline
        else:
            text = set_key(text, name, entry, table=base)
        shown = f"{base}.{name} = {args.value}"
    else:
        value = parse_value(base, args.value)
        text = set_key(text, base, value)
        shown = f"{base} = {_shown(base, value)}"
    _write(path, text)
    print(f"basal-local: {shown} in {path}")
    _note_overrides(base)
    return 0


def _example(key: str) -> Any:
    spec = _specs()[key]
    if spec.choices:
        return spec.choices[0]
    return {int: 1, float: 1.5, bool: "true", str: "TEXT", list: "NAME"}[spec.kind]


def text_has_table(text: str, table: str) -> bool:
    return any(line.strip().strip("[] ").strip('"') == table and line.strip().startswith("[")
               for line in text.splitlines())


def _note_overrides(key: str) -> None:
    spec = _specs()[key]
    if spec.env and os.environ.get(spec.env):
        print(f"  note: {spec.env} is set in this shell and wins over config.toml")
    print("  a running daemon keeps its settings until it restarts")


def unset(args: argparse.Namespace) -> int:
    key = _need(args.key, "unset")
    path = _path(args)
    text, data = _read(path)
    if key in data and key not in _specs():  # a key serve refuses: removing it is the fix
        text, _ = remove_key(text, key)
        _write(path, text)
        print(f"basal-local: removed the unknown key {key!r} from {path}")
        return 0
    base, name = _split(key)
    if base in TABLES and name is not None:
        if isinstance(data.get(base), dict) and not text_has_table(text, base):
            rest = {k: v for k, v in data[base].items() if k != name}
            removed = name in data[base]
            text = set_key(text, base, rest) if rest else remove_key(text, base)[0]
        else:
            text, removed = remove_key(text, name, table=base)
            if removed and not tomllib.loads(text).get(base):
                text = remove_key(text, "", table=base)[0]  # the last entry: the empty table goes too
    else:
        text, removed = remove_key(text, base)
        if base in TABLES:
            text, dropped = remove_key(text, "", table=base)
            removed = removed or dropped
    if not removed:
        print(f"basal-local: {key} is not in {path} (it has its default)")
        return 0
    _write(path, text)
    print(f"basal-local: removed {key} from {path}")
    _note_overrides(base)
    return 0


def keys(args: argparse.Namespace) -> int:
    rows = []
    for key, spec, default, engine in all_settings():
        rows.append({"key": key, "allowed": range_text(spec) + (" or unset" if spec.optional else ""),
                     "default": default, "flag": spec.flag, "env": spec.env, "help": spec.help.replace("%%", "%"),
                     "engine": engine})
    if args.json:
        print(json.dumps(rows, indent=1))
        return 0
    for r in rows:
        extra = "".join(f", {label} {r[name]}" for label, name in (("flag", "flag"), ("env", "env")) if r[name])
        print(f"{r['key']}: {r['allowed']}, default {_shown('', r['default'])}{extra}\n    {r['help']}")
    return 0


def validate(args: argparse.Namespace) -> int:
    path = _path(args)
    _read(path)
    rows = effective(args)
    changed = [r for r in rows if r["source"] != "default"]
    where = f"{path}" if path.is_file() else f"{path} (not there)"
    print(f"basal-local: ok: {where}; {len(changed)} of {len(rows)} settings not at their default")
    return 0


def path_(args: argparse.Namespace) -> int:
    path = _path(args)
    print(path)
    return 0


def config_command(args: argparse.Namespace) -> int:
    action = {"show": show, "path": path_, "get": get, "set": set_, "unset": unset, "keys": keys,
              "validate": validate}[args.action]
    if args.action in ("show", "path", "keys", "validate") and args.key:
        raise UserError(f"config {args.action} takes no KEY ({args.key!r})",
                        "`basal-local config get KEY` prints one setting")
    if args.action != "set" and args.value is not None:
        raise UserError(f"config {args.action} takes no VALUE ({args.value!r})",
                        "e.g. basal-local config set port 8001")
    return action(args)

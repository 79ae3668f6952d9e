"""Every setting is declared once (basal_local/settings.py): the `serve` flags, their --help defaults, the
config.toml keys, the environment and the validation all come from the declarations and agree with each other."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from basal_local.cli import build_parser
from basal_local.settings import EngineSettings, Settings, all_settings, check, flag_overrides


def serve_parser() -> argparse.ArgumentParser:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices["serve"]


def test_every_field_is_declared_and_every_flag_maps_to_its_field():
    declared = {key for key, *_ in all_settings()}
    names = {f.name for f in dataclasses.fields(Settings) if f.name != "engine"} | \
        {f.name for f in dataclasses.fields(EngineSettings)}
    assert declared == names
    actions = {a.option_strings[0]: a for a in serve_parser()._actions if a.option_strings}
    for key, spec, default, _ in all_settings():
        if spec.flag is None:
            continue
        action = actions[spec.flag]
        assert action.dest == (spec.dest or key)
        if spec.show_default:  # the --help default is the declared one
            shown = ("on" if default else "off") if isinstance(default, bool) else \
                f"{default:g}" if isinstance(default, float) else str(default)
            assert f"(default {shown})" in action.help, (spec.flag, action.help)


def test_a_flag_and_the_same_key_in_config_toml_give_the_same_settings(tmp_path):
    """For every flagged setting: a value given as the flag equals the value given as its config.toml key."""
    values = {"host": "127.0.0.2", "port": 8123, "backend": "torch", "device": "cpu", "devices": "cpu,cpu",
              "replicas": 2, "replica_processes": True, "dtype": "f32", "gpu_memory": "0.5",
              "default_model": "mini", "max_inflight": 7, "admission_wait_ms": 50.0, "access_log": True, "api_key": "k",
              "insecure_public": True, "allowed_hosts": ["a.example"], "allowed_origins": ["https://b.example"],
              "log_bodies": True, "body_timeout_s": 2.5, "drain_s": 3.0, "metrics": True, "models": ["mini"],
              "max_batch_tokens": 512, "schedule": "fifo", "long_tokens": 0, "long_slice_ms": 20.0,
              "prefix_cache": False, "coalesce_ms": 5.0, "pipeline": False, "keep_alive_s": 600.0}
    flagged = {key for key, spec, *_ in all_settings() if spec.flag}
    assert flagged == set(values)
    argv = ["serve"]
    specs = {key: spec for key, spec, *_ in all_settings()}
    for key, value in values.items():
        spec = specs[key]
        if spec.action in ("store_true", "negate", "boolean"):
            argv.append(spec.flag)
        elif isinstance(value, list):
            argv += [spec.flag, value[0]]
        else:
            argv += [spec.flag, str(value)]
    toml = "\n".join(f"{k} = {v!r}".replace("'", '"').replace("True", "true").replace("False", "false")
                     for k, v in values.items())
    (tmp_path / "config.toml").write_text(toml)
    empty = tmp_path / "none.toml"
    from_flags = Settings.load(flag_overrides(build_parser().parse_args(argv)), empty)
    from_file = Settings.load({}, tmp_path / "config.toml")
    assert from_flags == from_file
    assert from_file.engine.max_batch_tokens == 512 and from_file.port == 8123 and from_file.engine.pipeline is False


@pytest.mark.parametrize("text, key, message", [
    ("max_inflight = -3", "max_inflight", "max_inflight = -3: must be a whole number of at least 1"),
    ("max_batch_tokens = 0", "", "must be a whole number of at least 1"),
    ("body_timeout_s = -1", "", "must be a number above 0"),
    ("long_slice_ms = -5", "", "must be a number above 0"),
    ("max_inflight = 2.5", "", "must be a whole number"),
    ("metrics = 1", "", "must be true or false"),
    ("schedule = \"lifo\"", "", "must be one of hrrn, fifo"),
    ("port = 70000", "", "must be a whole number from 1 to 65535"),
    ("max_inflght = 3", "", "unknown setting 'max_inflght' (did you mean 'max_inflight'?)"),
    ("[aliases]\njev = 3", "", "[aliases] must map names"),
])
def test_bad_config_values_are_sentences_naming_the_file(tmp_path, text, key, message):
    path = tmp_path / "config.toml"
    path.write_text(text + "\n")
    with pytest.raises(ValueError) as err:
        Settings.load({}, path)
    assert str(err.value).startswith(str(path)) and message in str(err.value)


@pytest.mark.parametrize("argv, message", [
    (["--max-batch-tokens", "0"], "0 must be a whole number of at least 1"),
    (["--body-timeout", "-1"], "-1 must be a number above 0"),
    (["--long-slice-ms", "-5"], "-5 must be a number above 0"),
    (["--drain", "x"], "x must be a number of at least 0"),
    (["--port", "70000"], "70000 must be a whole number from 1 to 65535"),
])
def test_bad_flags_are_refused_by_the_parser(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_:
        build_parser().parse_args(["serve", *argv])
    assert exit_.value.code == 2 and message in capsys.readouterr().err


def test_environment_values_are_checked_too(tmp_path, monkeypatch):
    monkeypatch.setenv("BASAL_LOCAL_PORT", "abc")
    with pytest.raises(ValueError, match="BASAL_LOCAL_PORT: port = 'abc': must be a whole number"):
        Settings.load({}, tmp_path / "none.toml")
    monkeypatch.setenv("BASAL_LOCAL_PORT", "8100")
    assert Settings.load({"port": 8200}, tmp_path / "none.toml").port == 8200  # the flag wins
    assert Settings.load({}, tmp_path / "none.toml").port == 8100


def test_check_keeps_floats_exact_and_refuses_bools_as_numbers():
    spec = next(s for k, s, *_ in all_settings() if k == "max_inflight")
    with pytest.raises(ValueError):
        check("max_inflight", spec, True)
    assert check("max_inflight", spec, "12", from_text=True) == 12

"""`basal-local config`: the effective settings with their sources, and config.toml edited in place with every
value checked against its declaration (basal_local/settings.py) before anything is written."""

from __future__ import annotations

import json
import tomllib
from pathlib import Path

import pytest

from basal_local.settings import Settings

from .test_cli import assert_user_error, cli


def _file(home: dict) -> Path:
    return Path(home["BASAL_LOCAL_HOME"]) / "config.toml"


def _rows(home: dict, *flags: str, env: dict | None = None) -> dict:
    done = cli("config", "--json", *flags, env={**home, **(env or {})})
    assert done.returncode == 0, done.stderr
    return {r["key"]: r for r in json.loads(done.stdout)["settings"]}


def test_show_says_where_each_value_came_from(home):
    path = _file(home)
    path.parent.mkdir(parents=True)
    path.write_text("max_inflight = 7\nport = 8100\n")
    rows = _rows(home, "--drain", "3", env={"BASAL_LOCAL_PORT": "8200"})
    assert (rows["max_inflight"]["value"], rows["max_inflight"]["source"]) == (7, "config.toml")
    assert (rows["port"]["value"], rows["port"]["source"]) == (8200, "env BASAL_LOCAL_PORT")  # env over the file
    assert (rows["drain_s"]["value"], rows["drain_s"]["source"]) == (3.0, "flag --drain")
    assert (rows["schedule"]["value"], rows["schedule"]["source"]) == ("hrrn", "default")
    assert rows["long_tokens"]["engine"] and not rows["port"]["engine"]
    text = cli("config", env=home).stdout
    assert f"config file: {path}" in text
    line = next(x for x in text.splitlines() if x.startswith("max_inflight "))
    assert line.split() == ["max_inflight", "7", "config.toml"]


def test_the_api_key_is_never_shown(home):
    assert cli("config", "set", "api_key", "sekret", env=home).returncode == 0
    for args in (["config"], ["config", "--json"]):
        done = cli(*args, env=home)
        assert done.returncode == 0 and "sekret" not in done.stdout, done.stdout
    assert cli("config", "get", "api_key", env=home).stdout.strip() == "sekret"  # asked for by name: scripts


def test_set_checks_writes_and_keeps_the_rest_of_the_file(home):
    path = _file(home)
    path.parent.mkdir(parents=True)
    original = ("# my settings\nhost = \"127.0.0.1\"  # loopback only\nmodels = [\n  \"mini\",\n]\n\n"
                "# names the clients use\n[aliases]\njev-latest = \"mini\"\n")
    path.write_text(original)
    assert cli("config", "set", "port", "8001", env=home).returncode == 0
    assert cli("config", "set", "models", "mini, 4.5B", env=home).returncode == 0
    assert cli("config", "set", "access_log", "yes", env=home).returncode == 0
    assert cli("config", "set", "long_slice_ms", "25", env=home).returncode == 0
    text = path.read_text()
    assert text.startswith("# my settings\nhost = \"127.0.0.1\"  # loopback only\n")
    assert "# names the clients use\n[aliases]\njev-latest = \"mini\"\n" in text
    assert tomllib.loads(text) == {"host": "127.0.0.1", "models": ["mini", "4.5B"], "port": 8001,
                                   "access_log": True, "long_slice_ms": 25.0, "aliases": {"jev-latest": "mini"}}
    settings = Settings.load({}, path)
    assert (settings.port, settings.models, settings.engine.long_slice_ms) == (8001, ["mini", "4.5B"], 25.0)
    assert cli("config", "get", "models", env=home).stdout.strip() == '["mini", "4.5B"]'


@pytest.mark.parametrize("key, value, words", [
    ("max_inflight", "-3", ["max_inflight = -3: must be a whole number of at least 1"]),
    ("body_timeout_s", "-1", ["must be a number above 0"]),
    ("drain_s", "1e400", ["drain_s = inf: must be a number of at least 0"]),  # uvicorn cannot round inf
    ("long_slice_ms", "nan", ["must be a number above 0"]),
    ("schedule", "lifo", ["must be one of hrrn, fifo"]),
    ("port", "http", ["must be a whole number from 1 to 65535"]),
    ("access_log", "maybe", ["must be true or false"]),
    ("max_inflght", "3", ["unknown setting 'max_inflght'", "did you mean 'max_inflight'?"]),
    ("engine.schedule", "fifo", ["unknown setting", "config keys"]),
    ("aliases", "mini", ["aliases is a table", "aliases.NAME"]),
    ("port.x", "1", ["port is not a table"]),
])
def test_set_refuses_a_bad_value_and_leaves_the_file_alone(home, key, value, words):
    path = _file(home)
    path.parent.mkdir(parents=True)
    path.write_text("port = 8001\n")
    assert_user_error(cli("config", "set", key, value, env=home), *words)
    assert path.read_text() == "port = 8001\n"


def test_unset_goes_back_to_the_default(home):
    path = _file(home)
    assert cli("config", "set", "max_batch_tokens", "512", env=home).returncode == 0
    assert _rows(home)["max_batch_tokens"]["source"] == "config.toml"
    done = cli("config", "unset", "max_batch_tokens", env=home)
    assert done.returncode == 0 and "removed max_batch_tokens" in done.stdout
    assert _rows(home)["max_batch_tokens"] == {"key": "max_batch_tokens", "value": 8192, "default": 8192,
                                               "source": "default", "engine": True}
    assert tomllib.loads(path.read_text()) == {}
    done = cli("config", "unset", "max_batch_tokens", env=home)
    assert done.returncode == 0 and "not in" in done.stdout


def test_the_tables_take_dotted_keys(home):
    path = _file(home)
    assert cli("config", "set", "port", "8001", env=home).returncode == 0
    assert cli("config", "set", "aliases.jev-latest", "mini", env=home).returncode == 0
    assert cli("config", "set", "aliases.big one", "max", env=home).returncode == 0
    assert cli("config", "set", "placement.mini", "cuda:0,cuda:1", env=home).returncode == 0
    assert cli("config", "set", "port", "8002", env=home).returncode == 0  # a top-level key stays above the tables
    assert tomllib.loads(path.read_text()) == {"port": 8002, "aliases": {"jev-latest": "mini", "big one": "max"},
                                               "placement": {"mini": ["cuda:0", "cuda:1"]}}
    assert Settings.load({}, path).aliases == {"jev-latest": "mini", "big one": "max"}
    assert cli("config", "unset", "aliases.big one", env=home).returncode == 0
    assert cli("config", "unset", "placement.mini", env=home).returncode == 0  # its last entry: the table goes
    assert tomllib.loads(path.read_text()) == {"port": 8002, "aliases": {"jev-latest": "mini"}}
    assert "[placement]" not in path.read_text()
    path.write_text('port = 1\naliases = {a = "mini"}\n')  # an inline table stays one
    assert cli("config", "set", "aliases.b", "max", env=home).returncode == 0
    assert path.read_text() == 'port = 1\naliases = {a = "mini", b = "max"}\n'
    assert cli("config", "unset", "aliases", env=home).returncode == 0
    assert path.read_text() == "port = 1\n"


def test_path_keys_and_validate(home):
    path = _file(home)
    assert cli("config", "path", env=home).stdout.strip() == str(path)
    keys = json.loads(cli("config", "keys", "--json", env=home).stdout)
    port = next(k for k in keys if k["key"] == "port")
    assert port["allowed"] == "a whole number from 1 to 65535" and port["default"] == 8000
    assert port["flag"] == "--port" and port["env"] == "BASAL_LOCAL_PORT"
    assert "gpu_memory" in {k["key"] for k in keys} and "%%" not in json.dumps(keys)
    text = cli("config", "keys", env=home).stdout
    assert "schedule: one of hrrn, fifo, default hrrn, flag --schedule" in text
    done = cli("config", "validate", env=home)
    assert done.returncode == 0 and "ok" in done.stdout
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("max_inflight = -3\n")
    assert_user_error(cli("config", "validate", env=home), str(path), "max_inflight = -3")
    path.write_text("max_inflight = [\n")
    assert_user_error(cli("config", "validate", env=home), "not valid TOML")
    assert_user_error(cli("config", "set", "port", "1", env=home), "not valid TOML")


@pytest.mark.parametrize("args, words", [
    (["config", "get"], ["config get needs KEY"]),
    (["config", "get", "prot"], ["unknown setting 'prot'", "did you mean 'port'?"]),
    (["config", "set", "port"], ["needs a VALUE", "config set port 1"]),
    (["config", "path", "port"], ["takes no KEY"]),
    (["config", "unset", "port", "1"], ["takes no VALUE"]),
    (["config", "frob"], ["invalid choice: 'frob'"]),
    (["config", "--config", "/"], ["--config / is a folder, not a config file"]),  # it showed the defaults
    (["config", "set", "port", "8001", "--config", "/"], ["--config / is a folder"]),
    (["serve", "--demo", "--config", "/"], ["--config /: a folder, not a config file"]),
])
def test_config_mistakes_are_two_lines(home, args, words):
    assert_user_error(cli(*args, env=home), *words)


def test_an_empty_variable_does_not_override_the_file(home, monkeypatch):
    """BASAL_LOCAL_API_KEY= (empty) must not switch off the key config.toml sets for the daemon."""
    path = _file(home)
    path.parent.mkdir(parents=True)
    path.write_text('api_key = "from-file"\n')
    monkeypatch.setenv("BASAL_LOCAL_API_KEY", "")
    assert Settings.load({}, path).api_key == "from-file"
    assert _rows(home)["api_key"]["source"] == "config.toml"



def test_show_takes_serve_s_port_zero(home):
    assert (_rows(home, "--port", "0")["port"]["value"], _rows(home, "--port", "0")["port"]["source"]) == \
        (0, "flag --port")


def test_an_unknown_key_in_the_file_is_named_and_can_be_removed(home):
    path = _file(home)
    path.parent.mkdir(parents=True)
    path.write_text("port = 8001\nmax_inflght = 3\n")
    assert_user_error(cli("config", env=home), "unknown setting 'max_inflght'", "did you mean 'max_inflight'?")
    done = cli("config", "unset", "max_inflght", env=home)
    assert done.returncode == 0 and "removed the unknown key" in done.stdout, done.stderr
    assert path.read_text() == "port = 8001\n"
    assert cli("config", env=home).returncode == 0

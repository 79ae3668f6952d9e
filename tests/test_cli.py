"""The command line as a user meets it: every mistake is one or two lines and a non-zero exit, never a traceback;
models in a (fake, offline) Hugging Face cache; doctor; service files; ask and run against a live daemon."""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from basal_local import __version__

from .conftest import Daemon, cli_popen, cli_run, free_port


def cli(*args: str, env: dict | None = None, stdin: str | None = None):
    """`basal-local ARGS` in this process (fast: no interpreter start, torch already imported)."""
    from basal_local.cli import main

    saved_env, saved_stdin = dict(os.environ), sys.stdin
    os.environ.update(env or {})
    sys.stdin = io.TextIOWrapper(io.BytesIO((stdin or "").encode()), encoding="utf-8")
    out, err = io.StringIO(), io.StringIO()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                status = main(list(args))
            except SystemExit as exc:  # argparse
                status = exc.code
    finally:
        os.environ.clear()
        os.environ.update(saved_env)
        sys.stdin = saved_stdin
    return subprocess.CompletedProcess(args, status, out.getvalue(), err.getvalue())


def subcli(*args: str, env: dict | None = None, timeout: float = 300):
    """`basal-local ARGS` as its own process (for what only a process shows: exit status of serve, pipes)."""
    return cli_run([*args], capture_output=True, text=True,
                          input="", timeout=timeout, env={**os.environ, **(env or {})})


@pytest.fixture(scope="module")
def home(tmp_path_factory) -> dict:
    """An isolated BASAL_LOCAL_HOME and an empty Hugging Face cache (no network: the endpoint is a dead port)."""
    root = tmp_path_factory.mktemp("home")
    (root / "hub").mkdir()
    return {"BASAL_LOCAL_HOME": str(root / "basal"), "HF_HUB_CACHE": str(root / "hub"),
            "HF_ENDPOINT": f"http://127.0.0.1:{free_port()}", "HF_HUB_DISABLE_TELEMETRY": "1",
            "XDG_CONFIG_HOME": str(root / "xdg")}


def assert_user_error(done: subprocess.CompletedProcess, *words: str) -> None:
    """Non-zero, one or two lines on stderr, no traceback, and the words that name the cause/fix."""
    assert done.returncode != 0, done
    err = done.stderr.strip()
    assert "Traceback" not in err and "Traceback" not in done.stdout, err
    assert 1 <= len(err.splitlines()) <= 2, err
    for word in words:
        assert word in err, (word, err)


def test_version():
    done = subcli("--version")
    assert done.returncode == 0 and done.stdout.strip() == f"basal-local {__version__}"


def test_every_flag_has_help():
    from basal_local.cli import build_parser

    parser = build_parser()
    subparsers = next(a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction")
    for name, sub in subparsers.choices.items():
        for action in sub._actions:
            if action.option_strings and action.dest != "help":
                assert action.help, f"{name} {action.option_strings} has no help text"


@pytest.mark.parametrize("args,words", [
    (["prompts", "--model", "/no/such/dir"], ["/no/such/dir"]),
    (["prompts", "--model", "mini"], ["pull mini"]),
    (["show", "nonsense-name"], ["mini, 4.5B, max"]),
    (["bench", "--model", "/no/such/dir"], ["/no/such/dir"]),
    (["bench", "--http", "localhost:8000"], ["http://localhost:8000"]),
    (["bench", "--device", "tpu"], ["--device"]),
    (["serve", "--model", "/no/such/dir"], ["/no/such/dir"]),
    (["serve", "--demo", "--port", "70000"], ["--port", "65535"]),
    (["serve", "--demo", "--port", "abc"], ["--port"]),
    (["serve", "--demo", "--config", "/no/such/config.toml"], ["/no/such/config.toml"]),
    (["pull", "tiny"], ["mini, 4.5B, max"]),
    (["rm", "mini", "--yes"], ["not downloaded"]),
])
def test_user_errors_are_two_lines(home, args, words):
    assert_user_error(cli(*args, env=home), *words)


def test_not_a_model_directory(home, tmp_path):
    (tmp_path / "notes.txt").write_text("hello")
    for args in (["show", str(tmp_path)], ["prompts", "--model", str(tmp_path)], ["serve", "--model", str(tmp_path)]):
        assert_user_error(cli(*args, env=home), "config.json")


def test_unreachable_daemon_urls(home):
    dead = f"http://127.0.0.1:{free_port()}"
    assert_user_error(cli("bench", "--http", dead, env=home), "cannot reach", "--http")
    assert_user_error(cli("ask", "--url", dead, "--state", "x", "--noul", "ok?", env=home), "cannot reach")
    assert_user_error(cli("ps", "--url", dead, env=home), "cannot reach")


def test_cuda_without_cuda(home):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    assert_user_error(cli("serve", "--demo", "--device", "cuda", env=home), "--device cpu")


def test_malformed_config_names_the_file(home, tmp_path):
    bad = tmp_path / "config.toml"
    bad.write_text("port = [unclosed\n")
    assert_user_error(cli("serve", "--demo", "--config", str(bad), env=home), str(bad))
    bad.write_text('port = "eighty"\n')
    assert_user_error(cli("serve", "--demo", "--config", str(bad), env=home), str(bad), "port")


def test_busy_port_exits_before_the_banner(home, tiny_model):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = cli("serve", "--model", str(tiny_model), "--port", str(port), env=home)
    assert_user_error(done, "--port", str(port))
    assert "serving" not in done.stdout


@pytest.mark.parametrize(("host", "words"), [("8.8.8.8", ("not an address of this machine", "--host")),
                                             ("nonexistent.invalid", ("no address of that name", "--host"))])
def test_a_host_it_cannot_listen_on_is_named_as_such(home, tiny_model, host, words):
    """Not "port in use": an address of another machine, a name that resolves to nothing (with a key: a host
    other than the loopback needs one before anything is bound)."""
    done = cli("serve", "--model", str(tiny_model), "--host", host, "--api-key", "k", "--port", str(free_port()),
               env=home)
    assert_user_error(done, *words)
    assert "in use" not in done.stderr and "serving" not in done.stdout


def test_detach_and_tui_are_refused_together_before_anything_starts(home, tiny_model):
    done = cli("serve", "--model", str(tiny_model), "--detach", "--tui", env=home)
    assert_user_error(done, "--detach", "--tui")
    assert done.stdout == ""  # no daemon started in the background


def test_urls_of_an_ipv6_daemon_carry_brackets():
    from basal_local.addresses import http_url, local_url

    assert http_url("::1", 8000) == "http://[::1]:8000" and http_url("[::1]", 80) == "http://[::1]:80"
    assert http_url("127.0.0.1", 8000) == "http://127.0.0.1:8000" and local_url("::", 1) == "http://127.0.0.1:1"
    assert local_url("fe80::1", 9) == "http://[fe80::1]:9" and local_url("0.0.0.0", 8) == "http://127.0.0.1:8"


def test_serve_exits_non_zero_when_a_model_fails_to_load(home, tiny_model):
    # two models with the same basal.json name pass the early checks and fail while loading
    done = subcli("serve", "--model", str(tiny_model), "--model", str(tiny_model), "--port", str(free_port()),
                  "--device", "cpu", env=home)
    assert done.returncode == 1
    assert "two models are named" in done.stdout + done.stderr


def test_broken_pipe_is_quiet(home, tiny_model):
    proc = cli_popen(["show", str(tiny_model)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                     env={**os.environ, **home})
    proc.stdout.close()  # the reader is gone before the first line is written
    _, err = proc.communicate(timeout=300)
    assert b"Traceback" not in err and b"BrokenPipe" not in err, err


def test_demo_model_is_announced_only_when_generated(tmp_path, monkeypatch):
    from basal_local.model.registry import demo_model_dir

    monkeypatch.setenv("BASAL_LOCAL_HOME", str(tmp_path))
    told = []
    first = demo_model_dir(on_generate=told.append)
    second = demo_model_dir(on_generate=told.append)
    assert told == [first] and first == second and (first / "model.safetensors").exists()


# ---- models in a fake Hugging Face cache ------------------------------------------------------------------------

REV = "0123456789abcdef0123456789abcdef01234567"


def fake_hub_entry(hub: Path, model_dir: Path, repo: str = "Remek/basal-1.5-mini") -> Path:
    """The layout huggingface_hub writes: blobs, refs/main, snapshots/REV/<files as links to blobs>."""
    entry = hub / ("models--" + repo.replace("/", "--"))
    snap = entry / "snapshots" / REV
    (entry / "blobs").mkdir(parents=True)
    snap.mkdir(parents=True)
    (entry / "refs").mkdir()
    (entry / "refs" / "main").write_text(REV)
    for i, f in enumerate(sorted(model_dir.iterdir())):
        blob = entry / "blobs" / f"{i:040x}"
        shutil.copyfile(f, blob)
        try:
            (snap / f.name).symlink_to(os.path.relpath(blob, snap))
        except OSError:  # no symlinks (Windows without developer mode): huggingface_hub copies too
            shutil.copyfile(f, snap / f.name)
    return snap


def test_list_show_rm_with_a_fake_cache(home, tiny_model, tmp_path):
    env = {**home, "HF_HUB_CACHE": str(tmp_path / "hub")}
    snap = fake_hub_entry(tmp_path / "hub", tiny_model)
    listed = cli("list", "--json", env=env)
    assert listed.returncode == 0, listed.stderr
    rows = [r for r in json.loads(listed.stdout) if r["name"] == "mini"]
    assert len(rows) == 1
    expected_size = sum(f.stat().st_size for f in tiny_model.iterdir())
    assert rows[0]["revision"] == REV and rows[0]["refs"] == ["main"]
    assert rows[0]["size_bytes"] == expected_size and Path(rows[0]["path"]) == snap
    table = cli("list", env=env).stdout
    assert "mini" in table and REV[:12] in table

    shown = cli("show", "mini", "--json", env=env)
    assert shown.returncode == 0, shown.stderr
    info = json.loads(shown.stdout)
    config = json.loads((tiny_model / "config.json").read_text())
    calibration = json.loads((tiny_model / "CALIBRATION.json").read_text())
    assert info["architecture"]["layers"] == config["num_hidden_layers"]
    assert info["architecture"]["hidden_size"] == config["hidden_size"]
    assert info["calibration"]["temperatures"] == calibration["temperature_per_prim"]
    assert set(info["files"]) == {f.name for f in tiny_model.iterdir()}
    assert "temperature" in cli("show", "mini", env=env).stdout

    # the served model resolves by name too
    served = cli("prompts", "--model", "mini", env=env, stdin='{"model": "x", "state": "s", "questions": {}}')
    assert "Unknown model" in served.stdout

    refused = cli("rm", "mini", env=env)  # stdin is not a terminal: no silent deletion
    assert_user_error(refused, "--yes")
    assert snap.exists()
    removed = cli("rm", "mini", "--yes", env=env)
    assert removed.returncode == 0 and not snap.exists(), removed.stderr
    assert [r for r in json.loads(cli("list", "--json", env=env).stdout) if r["name"] == "mini"] == []


def test_pull_offline_is_one_line(home):
    done = cli("pull", "mini", env={**home, "HF_HUB_ETAG_TIMEOUT": "2", "HF_HUB_DOWNLOAD_TIMEOUT": "2"})
    assert done.returncode != 0
    err = done.stderr.strip()
    assert "Traceback" not in err and len(err.splitlines()) <= 2 and "cannot reach" in err, err


# ---- doctor and service -----------------------------------------------------------------------------------------

def test_doctor_json(home):
    done = cli("doctor", "--json", env=home)
    report = json.loads(done.stdout)
    names = {c["name"] for c in report["checks"]}
    assert {"python", "packages", "memory", "disk", "config", "port", "logs"} <= names
    assert all(c["status"] in ("ok", "warn", "fail") for c in report["checks"])
    failed = any(c["status"] == "fail" for c in report["checks"])
    assert report["ok"] is not failed and done.returncode == (1 if failed else 0)


def test_doctor_fails_on_a_malformed_config(home, tmp_path):
    (tmp_path / "config.toml").write_text("= nope")
    done = cli("doctor", "--json", env={**home, "BASAL_LOCAL_HOME": str(tmp_path)})
    assert done.returncode == 1
    config = next(c for c in json.loads(done.stdout)["checks"] if c["name"] == "config")
    assert config["status"] == "fail" and str(tmp_path / "config.toml") in config["detail"] and config["fix"]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="systemd user units are Linux-only")
def test_service_install_status_uninstall(home, tmp_path, tiny_model):
    env = {**home, "XDG_CONFIG_HOME": str(tmp_path / "xdg")}
    unit = tmp_path / "xdg" / "systemd" / "user" / "basal-local.service"
    printed = cli("service", "install", "--model", str(tiny_model), "--port", "8123", "--print", env=env)
    assert printed.returncode == 0 and not unit.exists()
    assert f"ExecStart={sys.executable} -m basal_local.cli serve --model {tiny_model} --port 8123" in printed.stdout
    installed = cli("service", "install", "--model", str(tiny_model), env=env)
    assert installed.returncode == 0 and unit.read_text().startswith("[Unit]")
    assert "systemctl --user" in installed.stdout and "logs" in installed.stdout
    assert cli("service", "status", env=env).returncode == 0
    assert cli("service", "uninstall", env=env).returncode == 0 and not unit.exists()
    assert_user_error(cli("service", "install", env=env), "--model")


def test_launchd_plist_is_valid_xml(tmp_path):
    import plistlib

    from basal_local.commands.service import render

    text = render("launchd", [sys.executable, "-m", "basal_local.cli", "serve", "--model", "a&b <c>"],
                  tmp_path / "log")
    plist = plistlib.loads(text.encode())
    assert plist["ProgramArguments"][-1] == "a&b <c>" and plist["StandardOutPath"] == str(tmp_path / "log")


# ---- ask, run, ps against a live daemon -------------------------------------------------------------------------

@pytest.fixture(scope="module")
def live(tiny_model, home):
    d = Daemon(["--model", str(tiny_model), "--device", "cpu"], env=home)
    d.wait_ready(timeout=600)
    yield d
    d.stop()


def test_ask_noul_choice_score(live, home, tmp_path):
    done = cli("ask", "--url", live.url, "--state", "The parcel arrived broken.", "--noul", "Is this urgent?",
               env=home)
    assert done.returncode == 0, done.stderr
    assert "Is this urgent?" in done.stdout and "true" in done.stdout and "█" in done.stdout
    state = tmp_path / "state.txt"
    state.write_text("Chcę zwrócić pieniądze.", encoding="utf-8")
    done = cli("ask", "--url", live.url, "--state", f"@{state}", "--choice", "What do they want?",
               "-o", "refund=A refund", "-o", "repair", "--json", env=home)
    body = json.loads(done.stdout)
    answer = body["answers"]["q"]
    assert answer["choice"] in ("refund", "repair") and set(answer["probabilities"]) == {"refund", "repair"}
    assert abs(sum(answer["probabilities"].values()) - 1) < 1e-6
    done = cli("ask", "--url", live.url, "--state", "x", "--score", "How bad?", "-l", "low", "-l", "high", env=home)
    assert done.returncode == 0 and "score" in done.stdout
    assert_user_error(cli("ask", "--url", live.url, "--state", "x", "--choice", "Q", "-o", "one", env=home),
                      "two options")
    assert_user_error(cli("ask", "--url", live.url, "--state", "x", "--choice", "Q", "-o", "a=1", "-o", "a=2",
                          env=home), "the key 'a' is given twice")
    assert_user_error(cli("ask", "--url", live.url, "--state", "x", "--noul", " ", env=home), "the question is empty")


def test_run_jsonl_in_order_with_accuracy(live, home, tmp_path):
    items = [{"state": f"message {i}", "question": "Is it urgent?", "gold": i % 2 == 0} for i in range(6)]
    items.append({"state": "refund please", "question": "Kind?", "options": {"refund": "Refund", "other": "Other"},
                  "gold": "refund"})
    items.append({"model": "jev-latest", "state": "full request",
                  "questions": {"a": {"type": "noul", "instructions": "ok?"}}})
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("\n".join(json.dumps(i) for i in items) + "\n")
    done = cli("run", "--url", live.url, "--input", str(src), "--output", str(out), "--concurrency", "4", env=home)
    assert done.returncode == 0, done.stderr
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["index"] for r in rows] == list(range(len(items)))
    assert all(r["status"] == 200 for r in rows)
    graded = [r for r in rows if "correct" in r]
    assert len(graded) == 7
    for row, item in zip(rows[:6], items[:6]):  # recompute the verdict from the answer itself
        assert row["correct"] == ((row["answers"]["q"]["noul"] >= 0.5) == item["gold"])
    accuracy = sum(r["correct"] for r in graded) / len(graded)
    assert f"accuracy {accuracy:.3f}" in done.stdout and "items/s" in done.stdout and "median latency" in done.stdout
    assert "a" in rows[-1]["answers"]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"state": "x"}\n')
    assert_user_error(cli("run", "--url", live.url, "--input", str(bad), "--output", str(out), env=home),
                      "bad.jsonl:1")
    # the answers in --output are never replaced unasked: a second run without --resume is refused
    kept = out.read_text()
    assert_user_error(cli("run", "--url", live.url, "--input", str(src), "--output", str(out), env=home),
                      f"already holds {len(items)} lines", "--resume", "--overwrite")
    assert out.read_text() == kept
    again = cli("run", "--url", live.url, "--input", str(src), "--output", str(out), "--overwrite", env=home)
    assert again.returncode == 0 and len(out.read_text().splitlines()) == len(items)
    foreign = tmp_path / "notes.txt"
    foreign.write_text("my notes\n")
    assert_user_error(cli("run", "--url", live.url, "--input", str(src), "--output", str(foreign), "--resume",
                          env=home), "holds no answers of a run", "--overwrite")
    assert foreign.read_text() == "my notes\n"


def test_ps_shows_the_loaded_model(live, home, tiny_model):
    from basal_local.commands import human_bytes

    done = cli("ps", "--url", live.url, "--json", env=home)
    info = json.loads(done.stdout)
    assert info["ready"] and info["version"] == __version__
    (model,) = info["models"]
    assert model["path"] == str(tiny_model) and model["default"] and model["device"] == "cpu"
    weights = (tiny_model / "model.safetensors").stat().st_size
    assert 0.5 * weights < model["weights_bytes"] <= 2.5 * weights  # f32 copy of the stored weights
    text = cli("ps", "--url", live.url, env=home).stdout
    assert "(default)" in text and "cpu" in text
    # the state cache: what it holds of its budget (a column of its own; /api/ps had no cache figures)
    cache = model["prefix_cache"]
    assert cache["enabled"] and 0 < cache["bytes"] <= cache["budget_bytes"] == model["prefix_cache_bytes"]
    header, row = text.splitlines()[1:3]
    at = header.index("CACHE")
    assert row[at:header.index("QUEUE")].strip() == f"{human_bytes(cache['bytes'])}/{human_bytes(cache['budget_bytes'])}"


def test_an_option_before_the_command_is_named():
    """`basal-local -x` said only that COMMAND was missing, `basal-local --config F serve` that F is no command."""
    for argv, first in ((["-x"], "-x"), (["--config", "/x", "serve"], "--config"), (["--port=9", "serve"], "--port")):
        assert_user_error(cli(*argv), f"{first} is not an option of basal-local itself", "go after it")
    assert_user_error(cli("frob"), "invalid choice: 'frob'")
    assert_user_error(cli("-v", "frob"), "invalid choice: 'frob'")

"""Everyday use of the daemon and its tools: stopping, the log file, keys, interruptions, `run`'s output.

Signals and exit codes are checked on real processes (the suite's forked CLI); nothing here needs a terminal.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest

from .conftest import Daemon, cli_popen, free_port


def _open_events(port: int) -> socket.socket:
    """An /api/events reader that has read the stream's first comment."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    sock.sendall(f"GET /api/events HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n\r\n".encode())
    head = b""
    while b"basal-local events" not in head:
        chunk = sock.recv(4096)
        assert chunk, head
        head += chunk
    return sock


def _read_to_eof(sock: socket.socket) -> bytes:
    rest = b""
    while chunk := sock.recv(4096):
        rest += chunk
    return rest


def test_ctrl_c_twice_stops_at_once_without_a_traceback(tiny_model, home):
    """A second Ctrl-C right after the first stops at once: uvicorn logged the cancelled lifespan task's traceback."""
    d = Daemon(["--model", str(tiny_model), "--device", "cpu"], env=home)
    try:
        d.wait_ready()
        d.proc.send_signal(signal.SIGINT)
        time.sleep(0.05)
        d.proc.send_signal(signal.SIGINT)
        assert d.proc.wait(timeout=30) == 0
    finally:
        log = d.stop()
    assert "Traceback" not in log and "CancelledError" not in log, log
    assert "basal-local: stopped" in log


def test_ctrl_c_while_the_models_load_stops_cleanly(tiny_model, home):
    """Ctrl-C right after the banner, while the models load in the background and before uvicorn serves: a
    graceful stop, no warning (a KeyboardInterrupt there left uvicorn's serve coroutine never awaited)."""
    d = Daemon(["--model", str(tiny_model), "--device", "cpu"], env=home)
    try:
        deadline = time.time() + 120
        while "loading models" not in d.log and d.proc.poll() is None and time.time() < deadline:
            time.sleep(0.002)
        d.proc.send_signal(signal.SIGINT)
        assert d.proc.wait(timeout=60) == 0
    finally:
        log = d.stop()
    assert "Traceback" not in log and "Warning" not in log and "never awaited" not in log, log
    assert "basal-local: stopped" in log


def test_sigint_with_an_event_reader_attached_stops_at_once_and_cleanly(tiny_model, home):
    # a drain far longer than the wait below: the stop must not wait for the stream at all
    d = Daemon(["--model", str(tiny_model), "--device", "cpu", "--drain", "60"], env=home)
    try:
        d.wait_ready()
        readers = [_open_events(d.port), _open_events(d.port)]
        readers[1].close()  # one reader gone: its stream only notices on its next write
        d.proc.send_signal(signal.SIGINT)
        assert d.proc.wait(timeout=30) == 0
        rest = _read_to_eof(readers[0])
        assert rest.endswith(b"0\r\n\r\n"), rest[-200:]  # the chunked body ended, not a reset connection
        readers[0].close()
    finally:
        log = d.stop()
    assert "Traceback" not in log and "Cancel" not in log and "ASGI" not in log, log
    assert "basal-local: stopped" in log


def test_the_log_file_is_written_and_doctor_checks_it(tiny_model, home):
    d = Daemon(["--model", str(tiny_model), "--device", "cpu"], env=home)
    try:
        d.wait_ready()
    finally:
        log = d.stop()
    path = Path(home["BASAL_LOCAL_HOME"]) / "logs" / "basal-local.log"
    assert f"log: {path}" in log
    text = path.read_text(encoding="utf-8")
    assert "basal_local.daemon: loaded" in text, text  # our format, our records
    from .test_cli import cli

    done = cli("doctor", "--json", env=home)
    (check,) = [c for c in json.loads(done.stdout)["checks"] if c["name"] == "logs"]
    assert check["status"] == "ok", check
    assert path.read_text(encoding="utf-8") == text  # the log holds the daemon's lines only (doctor probes beside it)
    assert [p.name for p in path.parent.iterdir()] == [path.name]
    path.unlink()
    path.mkdir()  # a log path that cannot be written (a folder in its place; even root cannot write it)
    done = cli("doctor", "--json", env=home)
    (check,) = [c for c in json.loads(done.stdout)["checks"] if c["name"] == "logs"]
    assert check["status"] == "warn" and "cannot be written" in check["detail"], check


def _wait_for(predicate, timeout: float = 60.0) -> None:
    deadline = time.time() + timeout
    while not predicate():
        assert time.time() < deadline, "timed out waiting"
        time.sleep(0.05)



# ---- start-up: -v anywhere, --port 0, failures without the demo's "try it", devices as one sentence ------------

def test_verbose_after_the_subcommand(home):
    from .test_cli import cli

    done = cli("doctor", "--json", "-v", env=home)
    assert "checks" in json.loads(done.stdout), done.stderr
    assert cli("list", "-v", env=home).returncode == 0


def test_port_zero_listens_on_a_free_port_and_says_which(tiny_model, home):
    import re

    proc = cli_popen(["serve", "--model", tiny_model, "--device", "cpu", "--port", "0"],
                     env={**os.environ, **home}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        first = proc.stdout.readline() + proc.stdout.readline()
        found = re.search(r"serving on http://127\.0\.0\.1:(\d+) ", first)
        assert found, first
        port = int(found.group(1))
        assert port != 0
        from .conftest import http

        def ready() -> bool:
            try:
                return http("GET", f"http://127.0.0.1:{port}/health", timeout=2)[0] == 200
            except OSError:
                return False

        _wait_for(ready, timeout=240)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=60)
    assert proc.returncode == 0


def test_a_failed_start_shows_no_try_it_text(tiny_model, home, tmp_path):
    import shutil

    from .test_cli import subcli

    twin = tmp_path / "twin"
    shutil.copytree(tiny_model, twin)
    meta = json.loads((twin / "basal.json").read_text())
    (twin / "basal.json").write_text(json.dumps({**meta, "name": "basal-demo"}))  # the demo's name: load fails
    done = subcli("serve", "--demo", "--model", str(twin), "--port", str(free_port()), "--device", "cpu", env=home)
    out = done.stdout + done.stderr
    assert done.returncode == 1 and "two models are named" in out, out
    assert "Try it" not in out and "curl" not in out, out


@pytest.mark.parametrize("spec, words", [("banana", ["'banana' is not a device", "cuda:N"]),
                                         ("cuda:0,cuda:1", ["--devices cuda:0,cuda:1"])])
def test_devices_mistakes_are_one_sentence(home, spec, words):
    import torch

    from .test_cli import assert_user_error, cli

    if spec.startswith("cuda") and torch.cuda.device_count() >= 2:
        pytest.skip("two GPUs here: the spec is valid (the case checks the refusal without them)")
    assert_user_error(cli("serve", "--demo", "--devices", spec, env=home), *words)


# ---- user mistakes that were "internal error ... please report it" ----------------------------------------------

def test_make_test_model_into_a_folder_it_cannot_create(home, tmp_path):
    from .test_cli import assert_user_error, cli

    (tmp_path / "file").write_text("x")
    assert_user_error(cli("make-test-model", str(tmp_path / "file" / "model"), env=home),
                      "cannot write the test model", "a folder you can write to")


def test_a_home_folder_through_a_file_is_one_sentence(tmp_path):
    from .test_cli import assert_user_error, cli

    (tmp_path / "file").write_text("x")
    done = cli("serve", "--demo", "--port", "0", env={"BASAL_LOCAL_HOME": str(tmp_path / "file" / "home")})
    assert_user_error(done, "cannot use", "Not a directory", "BASAL_LOCAL_HOME")


def test_the_demo_model_leaves_no_half_written_folder(tmp_path, monkeypatch):
    """Ctrl-C while the demo model is generated removes its folder; one a killed process left is dropped."""
    import basal_local.model.registry as registry
    import basal_local.model.testmodel as testmodel

    monkeypatch.setenv("BASAL_LOCAL_HOME", str(tmp_path))
    cache = registry.demo_model_path().parent
    cache.mkdir(parents=True)
    dead = subprocess.Popen(["true"])
    dead.wait()
    (cache / f"demo-model.tmp{dead.pid}").mkdir()  # a generation killed mid-way

    def interrupted(directory, **kw):
        Path(directory).mkdir()
        (Path(directory) / "config.json").write_text("{")
        raise KeyboardInterrupt

    monkeypatch.setattr(testmodel, "make_test_model", interrupted)
    with pytest.raises(KeyboardInterrupt):
        registry.demo_model_dir()
    assert list(cache.iterdir()) == []
    monkeypatch.undo()
    monkeypatch.setenv("BASAL_LOCAL_HOME", str(tmp_path))
    assert (registry.demo_model_dir() / "basal.json").exists() and [p.name for p in cache.iterdir()] == ["demo-model"]


@pytest.mark.parametrize("fmt, package", [("mlx-8bit", "mlx"), ("gguf-q8_0", "gguf")])
def test_make_test_model_names_a_missing_layout_package_before_writing(home, tmp_path, monkeypatch, fmt, package):
    import importlib.util

    from .test_cli import assert_user_error, cli

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == package else real(name, *a))
    out = tmp_path / "model"
    assert_user_error(cli("make-test-model", str(out), "--format", fmt, env=home),
                      f"--format {fmt} is written with the {package} package", "pip install")
    assert not out.exists()  # nothing written to convert


@pytest.mark.parametrize("fmt, words", [("mlx-8bit", ("groups of 64", "160", "--preset tiny64")),
                                         ("gguf-q4_k_m", ("rows of 256", "--preset tiny256"))])
def test_make_test_model_refuses_a_format_the_preset_cannot_take_before_writing(home, tmp_path, fmt, words):
    """mlx-8bit on `tiny` wrote a whole bf16 model and then failed, leaving it servable as bf16; gguf-q4_k_m on
    `tiny` wrote every matrix as Q8_0 and labelled the file 4-bit."""
    pytest.importorskip("mlx.core" if fmt.startswith("mlx") else "gguf")
    from .test_cli import assert_user_error, cli

    (tmp_path / "work").mkdir()
    out = tmp_path / "work" / "model"
    assert_user_error(cli("make-test-model", str(out), "--format", fmt, env=home), *words)
    assert list((tmp_path / "work").iterdir()) == []


@pytest.mark.parametrize("failure", [KeyboardInterrupt, ValueError, OSError, "a move"])
def test_a_failed_or_interrupted_make_test_model_leaves_what_was_there(home, tmp_path, monkeypatch, failure):
    """The model is written in a side folder and moved in when complete, the earlier one set aside and put back on
    any failure: an interrupt (or a failed conversion, a full disk, a move that fails half-way) while the format
    was written left a servable bf16 model where another format was asked for. Now a new folder is not created,
    and an earlier test model in it stays as it was."""
    import errno

    import basal_local.commands.maketest as maketest

    from .test_cli import assert_user_error, cli

    def failing(directory, fmt, **kw):
        (directory / "half.gguf").write_bytes(b"GGUF")
        if failure == "a move":
            return
        raise failure("disk full") if failure is not KeyboardInterrupt else failure

    monkeypatch.setattr(maketest, "convert_test_model", failing)
    tmp_path = tmp_path / "work"  # (the home is in tmp_path too)
    tmp_path.mkdir()
    earlier = tmp_path / "earlier"
    assert cli("make-test-model", str(earlier), "--seed", "1", env=home).returncode == 0
    files = {p.name: p.read_bytes() for p in earlier.iterdir()}
    if failure == "a move":  # the third file moved in fails (a rename across filesystems would)
        real, moved = Path.rename, []

        def rename(self, target):
            if self.parent.name.startswith(".making-"):
                moved.append(self)
                if sum(m.parent == self.parent for m in moved) == 3:  # the third of each run
                    raise OSError(errno.EXDEV, "Invalid cross-device link")
            return real(self, target)

        monkeypatch.setattr(Path, "rename", rename)
    fresh = tmp_path / "fresh"
    done = cli("make-test-model", str(fresh), "--format", "gguf-q8_0", env=home)
    assert_user_error(done, {KeyboardInterrupt: "interrupted: ", "a move": "cross-device"}.get(failure, "disk full"),
                      "as it was")
    assert not fresh.exists()
    assert_user_error(cli("make-test-model", str(earlier), "--format", "gguf-q8_0", env=home), "as it was")
    assert {p.name: p.read_bytes() for p in earlier.iterdir()} == files  # no side folder left either
    assert sorted(p.name for p in tmp_path.iterdir()) == ["earlier"]


def test_make_test_model_works_in_its_folder_alone(home, tmp_path):
    """Written inside the target (a mount point is its own filesystem; its parent may be read-only): a folder whose
    parent cannot be written takes a test model, and a side folder a killed run left is dropped."""
    from .test_cli import cli

    parent = tmp_path / "ro"
    out = parent / "model"
    out.mkdir(parents=True)
    dead = subprocess.Popen(["true"])
    dead.wait()
    (out / f".making-{dead.pid}").mkdir()
    parent.chmod(0o555)
    try:
        done = cli("make-test-model", str(out), env=home)
    finally:
        parent.chmod(0o755)
    assert done.returncode == 0, done.stderr
    assert (out / "basal.json").exists() and not [p for p in out.iterdir() if p.name.startswith(".")]


def test_bench_checks_its_extras_before_running(home, monkeypatch):
    import importlib.util

    import basal_local.backends.select as select

    from .test_cli import assert_user_error, cli

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "transformers" else real(name, *a))
    done = cli("bench", "--baseline", "transformers", env=home)
    assert_user_error(done, "needs Hugging Face transformers", "drop --baseline")
    assert "single decisions" not in done.stderr  # refused before the bench ran
    monkeypatch.setattr(select, "mlx_importable", lambda: False)
    assert_user_error(cli("bench", "--backend", "mlx", env=home), "MLX is not installed", "--backend torch")
    done = cli("serve", "--demo", "--backend", "mlx", "--port", "0", env=home)  # before `serving on`, not after
    assert_user_error(done, "MLX is not installed", "mlx[cpu]")
    assert "serving on" not in done.stdout
    for attention, why in (("tree", "needs CUDA and Triton"), ("metal", "unknown attention 'metal'")):
        assert_user_error(cli("bench", "--device", "cpu", "--attention", attention, "--decisions", "1", env=home),
                          f"--attention {attention}: ", why, "--attention auto")


def test_service_install_refuses_a_model_that_is_not_there(home, tmp_path):
    from .test_cli import assert_user_error, cli

    assert_user_error(cli("service", "install", "--model", "mini", "--print", env=home), "mini")
    assert_user_error(cli("service", "install", "--model", str(tmp_path / "nothing"), "--print", env=home))


def test_service_unit_does_not_restart_on_a_user_mistake(home, tmp_path):
    from basal_local.commands.service import render

    from .test_cli import subcli

    assert "RestartPreventExitStatus=2" in render("systemd", ["basal-local", "serve"], tmp_path / "log")
    # what the unit runs exits 2 when its model has gone: systemd then leaves it stopped
    done = subcli("serve", "--model", str(tmp_path / "gone"), "--port", str(free_port()), env=home)
    assert done.returncode == 2


def test_bench_progress_says_how_far_and_how_long_is_left(capsys):
    from basal_local.bench import Ticker

    now = [0.0]
    ticker = Ticker("single decisions", 10, every_s=5.0, clock=lambda: now[0])
    lines = []
    for _ in range(10):
        lines.append(ticker.step())
        now[0] += 2.0  # each item takes 2 s
    shown = [line for line in lines if line]
    # after 3 items (6 s): 7 left at 2 s each; the next line 5 s later at least
    assert shown[0] == "single decisions 3/10, about 14 s left"
    assert shown[1] == "single decisions 6/10, about 8 s left"
    assert "single decisions 3/10" in capsys.readouterr().err


# ---- the daemon in the background ----------------------------------------------------------------------------

def test_detach_status_logs_stop(tiny_model, home):
    from .test_cli import subcli

    done = subcli("serve", "--detach", "--model", str(tiny_model), "--device", "cpu", "--port", "0", env=home)
    state = Path(home["BASAL_LOCAL_HOME"]) / "state" / "daemon.json"
    try:
        assert done.returncode == 0, done.stdout + done.stderr
        assert "ready on http://127.0.0.1:" in done.stdout
        info = json.loads(state.read_text())
        status = subcli("status", env=home)
        assert status.returncode == 0 and f"pid {info['pid']}" in status.stdout and "ready" in status.stdout
        # the other commands find it on its own port too, without --url (it is not the configured 8000)
        ps = subcli("ps", "--json", env=home)
        assert ps.returncode == 0 and json.loads(ps.stdout)["ready"], ps.stderr
        asked = subcli("ask", "--state", "x", "--noul", "Is it urgent?", env=home)
        assert asked.returncode == 0 and "Traceback" not in asked.stderr, asked.stderr
        logs = subcli("logs", env=home)
        assert "basal-local: ready:" in logs.stdout
        assert logs.stdout.count("basal_local.daemon: loaded") == 1  # stdout and the log handler: one copy
        again = subcli("serve", "--detach", "--model", str(tiny_model), "--device", "cpu", env=home)
        assert again.returncode == 2 and "already running" in again.stderr
        restarted = subcli("restart", env=home)
        assert restarted.returncode == 0, restarted.stdout + restarted.stderr
        after = json.loads(state.read_text())
        assert after["pid"] != info["pid"] and after["port"] == info["port"] and after["argv"] == info["argv"]
        assert "ready" in subcli("status", env=home).stdout
    finally:
        stopped = subcli("stop", env=home)
    assert stopped.returncode == 0, stopped.stderr
    assert not state.exists()
    assert subcli("status", env=home).returncode == 3
    assert subcli("stop", env=home).returncode == 1
    assert subcli("restart", env=home).returncode == 1


def test_weights_that_give_nan_name_the_model_and_its_folder(tiny_model, tmp_path):
    """A damaged weights file said only "loading failed: non-finite letter logit"."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    from basal_local.backends.torch import TorchBackend
    from basal_local.engine.engine import EngineSettings, ModelEngine
    from basal_local.engine.gate import DeviceGate
    from basal_local.model import load_model_dir
    from basal_local.telemetry import Telemetry

    broken = tmp_path / "broken"
    shutil.copytree(tiny_model, broken)
    weights = load_file(broken / "model.safetensors")
    weights["model.layers.0.input_layernorm.weight"].fill_(float("nan"))
    save_file(weights, broken / "model.safetensors", metadata={"format": "pt"})
    backend = TorchBackend("cpu")
    backend.load(broken, "f32")
    with pytest.raises(FloatingPointError, match=f"basal-test-tiny: its first forward gave a non-finite .*{broken}"):
        ModelEngine(load_model_dir(broken), backend, DeviceGate(), Telemetry(), EngineSettings())
    assert torch.isnan(weights["model.layers.0.input_layernorm.weight"]).all()

"""`serve --detach`, `stop`, `status`, `logs [-f]`: the daemon in the background without a service manager.

The detached daemon is `basal-local serve` with the same arguments in its own session, its output appended to
basal-local.log; its pid, port and URL are kept in `daemon.json` in the state folder until it is stopped.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from ..addresses import local_url
from ..paths import home_dirs, process_alive
from . import UserError, bind_ephemeral, get_json, listen_error, port_free

START_TIMEOUT_S = 600  # loading a large model from a cold disk


def state_file() -> Path:

    return home_dirs()["state"] / "daemon.json"


def log_path() -> Path:

    return home_dirs()["logs"] / "basal-local.log"


def read_state() -> dict[str, Any] | None:
    try:
        return json.loads(state_file().read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def detach(argv: list[str], host: str, port: int) -> int:
    """Start `serve argv` in the background and wait until it answers /health (or fails)."""

    running = read_state()
    if running and process_alive(running["pid"]):
        raise UserError(f"a background daemon is already running (pid {running['pid']}, {running['url']})",
                        "stop it with `basal-local stop`, or start this one in the foreground")
    if port == 0:  # the child is told the port, so this command can say it
        with bind_ephemeral(host) as sock:
            port = sock.getsockname()[1]
    elif (problem := listen_error(host, port)) is not None:
        raise problem
    url = local_url(host, port)
    log = log_path()
    log.parent.mkdir(parents=True, exist_ok=True)
    state_file().parent.mkdir(parents=True, exist_ok=True)
    with open(log, "ab") as out:
        child = subprocess.Popen([sys.executable, "-m", "basal_local.cli", "serve", *argv, "--port", str(port)],
                                 stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                 start_new_session=True)  # Ctrl-C in this terminal no longer reaches it
    state_file().write_text(json.dumps({"pid": child.pid, "port": port, "host": host, "url": url,
                                        "started": time.time(), "log": str(log), "argv": list(argv)}),
                            encoding="utf-8")
    print(f"basal-local: starting in the background (pid {child.pid}) on {url}; log: {log}", flush=True)
    deadline = time.time() + START_TIMEOUT_S
    while time.time() < deadline:
        if child.poll() is not None:
            state_file().unlink(missing_ok=True)
            tail = log.read_text(encoding="utf-8", errors="replace").splitlines()[-5:]
            raise UserError(f"the daemon exited while starting (status {child.returncode}): "
                            + (tail[-1] if tail else "no output"), f"see {log} (`basal-local logs`)", status=1)
        try:
            get_json(url, "/health", timeout=2)
            print(f"basal-local: ready on {url}; stop it with `basal-local stop`")
            return 0
        except UserError:
            time.sleep(0.2)
    print(f"basal-local: still loading after {START_TIMEOUT_S} s; `basal-local status` tells when it is ready")
    return 0


def restart_command(args: argparse.Namespace) -> int:
    """Stop the `serve --detach` daemon and start it again with the same arguments and port (a new model file,
    a changed config.toml)."""
    running = read_state()
    if not running or not process_alive(running["pid"]):
        state_file().unlink(missing_ok=True)
        raise UserError("no background daemon is running", "start one with `basal-local serve --detach ...`", status=1)
    if "argv" not in running:
        raise UserError("the background daemon was started by an older basal-local (its arguments are not known)",
                        "`basal-local stop`, then `basal-local serve --detach ...` again", status=1)
    stop_command(args)
    deadline = time.time() + 10.0  # the old process has exited; its port may linger a moment

    while not port_free(running["host"], running["port"]) and time.time() < deadline:
        time.sleep(0.2)
    return detach(running["argv"], running["host"], running["port"])


def stop_command(args: argparse.Namespace) -> int:
    running = read_state()
    if not running or not process_alive(running["pid"]):
        state_file().unlink(missing_ok=True)
        raise UserError("no background daemon is running", "start one with `basal-local serve --detach ...`", status=1)
    os.kill(running["pid"], signal.SIGTERM)  # graceful: requests in flight get the drain time
    deadline = time.time() + args.timeout
    while process_alive(running["pid"]) and time.time() < deadline:
        time.sleep(0.1)
        try:
            os.waitpid(running["pid"], os.WNOHANG)  # our own child only when started from this process
        except ChildProcessError:
            pass
    if process_alive(running["pid"]):
        raise UserError(f"the daemon (pid {running['pid']}) did not stop within {args.timeout:g} s",
                        f"run `basal-local stop` again, or kill {running['pid']}", status=1)
    state_file().unlink(missing_ok=True)
    print(f"basal-local: stopped the daemon (pid {running['pid']}, {running['url']})")
    return 0


def status_command(args: argparse.Namespace) -> int:
    running = read_state()
    if not running or not process_alive(running["pid"]):
        print("basal-local: no background daemon is running")
        return 3  # systemctl's "not running"
    try:
        health = get_json(running["url"], "/health", timeout=2)
        what = f"ready, serving {', '.join(health.get('models', []))}"
    except UserError as err:
        what = err.cause.removeprefix(f"the daemon at {running['url']} ")
    print(f"basal-local: running (pid {running['pid']}) on {running['url']}: {what}\n  log: {running['log']}")
    return 0


def logs_command(args: argparse.Namespace) -> int:
    path = log_path()
    if not path.exists():
        raise UserError(f"no log yet ({path})", "the daemon writes it once it has started", status=1)
    with open(path, encoding="utf-8", errors="replace") as log:
        lines = log.readlines()
        sys.stdout.writelines(lines[-args.lines:] if args.lines else lines)
        sys.stdout.flush()
        while args.follow:  # until Ctrl-C
            line = log.readline()
            if line:
                sys.stdout.write(line)
                sys.stdout.flush()
            else:
                time.sleep(0.2)
    return 0

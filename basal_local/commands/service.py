"""`basal-local service install|uninstall|status|start|stop|restart|logs`: the daemon in the background, the
platform's way.

Linux: a systemd user unit (`~/.config/systemd/user/basal-local.service`); macOS: a launchd agent
(`~/Library/LaunchAgents/dev.basal-local.daemon.plist`). Logs go to the platformdirs log folder (and the journal
on Linux). `install` writes the file and says how to enable it; start/stop/restart run systemctl or launchctl;
where the service manager is missing (a container, WSL without systemd) they say so in one sentence and exit 1.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
from pathlib import Path
from xml.sax.saxutils import escape

from ..paths import home_dirs
from . import UserError, model_path
from .background import logs_command
from .serving import load_settings

UNIT = "basal-local.service"
LABEL = "dev.basal-local.daemon"


def serve_argv(args: argparse.Namespace) -> list[str]:
    argv = [sys.executable, "-m", "basal_local.cli", "serve"]
    for model in args.model or []:
        path = Path(model).expanduser()
        argv += ["--model", str(path.resolve()) if path.exists() else model]
    if args.port:
        argv += ["--port", str(args.port)]
    return argv


def unit_path(kind: str) -> Path:
    if kind == "systemd":
        base = Path(os.environ.get("XDG_CONFIG_HOME") or Path.home() / ".config")
        return base / "systemd" / "user" / UNIT
    return Path.home() / "Library" / "LaunchAgents" / f"{LABEL}.plist"


def platform_kind() -> str:
    if sys.platform.startswith("linux"):
        return "systemd"
    if sys.platform == "darwin":
        return "launchd"
    raise UserError(f"`service` supports Linux (systemd) and macOS (launchd), not {sys.platform}",
                    "on Windows run `basal-local serve` from Task Scheduler (at log on) instead")


def _quote(arg: str) -> str:
    """systemd ExecStart quoting: double quotes around anything with spaces, quotes or backslashes."""
    if arg and not any(c in arg for c in ' "\\\'$%'):
        return arg
    return '"' + arg.replace("\\", "\\\\").replace('"', '\\"').replace("$", "$$").replace("%", "%%") + '"'


def render(kind: str, argv: list[str], log_file: Path) -> str:
    env = {k: v for k, v in os.environ.items() if k in ("BASAL_LOCAL_HOME", "HF_HOME", "HF_HUB_CACHE")}
    if kind == "systemd":
        env_lines = "".join(f"Environment={_quote(f'{k}={v}')}\n" for k, v in env.items())
        return ("[Unit]\nDescription=basal-local: Basal decision models on localhost\nAfter=network.target\n\n"
                f"[Service]\nExecStart={' '.join(_quote(a) for a in argv)}\n{env_lines}"
                "Environment=PYTHONUNBUFFERED=1\nRestart=on-failure\nRestartSec=5\n"
                # exit 2 is a user mistake (a model not downloaded, a bad setting): restarting cannot fix it
                "RestartPreventExitStatus=2\n\n"
                "[Install]\nWantedBy=default.target\n")
    args_xml = "".join(f"    <string>{escape(a)}</string>\n" for a in argv)
    env_xml = "".join(f"    <key>{escape(k)}</key><string>{escape(v)}</string>\n"
                      for k, v in {**env, "PYTHONUNBUFFERED": "1"}.items())
    return ('<?xml version="1.0" encoding="UTF-8"?>\n'
            '<!DOCTYPE plist PUBLIC "-//Apple//DTD PLIST 1.0//EN" "http://www.apple.com/DTDs/PropertyList-1.0.dtd">\n'
            f'<plist version="1.0">\n<dict>\n  <key>Label</key><string>{LABEL}</string>\n'
            f"  <key>ProgramArguments</key>\n  <array>\n{args_xml}  </array>\n"
            f"  <key>EnvironmentVariables</key>\n  <dict>\n{env_xml}  </dict>\n"
            "  <key>RunAtLoad</key><true/>\n  <key>KeepAlive</key><dict><key>SuccessfulExit</key><false/></dict>\n"
            f"  <key>StandardOutPath</key><string>{escape(str(log_file))}</string>\n"
            f"  <key>StandardErrorPath</key><string>{escape(str(log_file))}</string>\n"
            "</dict>\n</plist>\n")


MANAGER = {"systemd": ("systemctl", "systemd"), "launchd": ("launchctl", "launchd")}


def manage(kind: str, argv: list[str], what: str) -> subprocess.CompletedProcess:
    """Run the service manager; its absence or a refusal is a UserError (exit 1) in one sentence."""
    tool, name = MANAGER[kind]
    if shutil.which(tool) is None:
        raise UserError(f"`service {what}` needs {name}, and there is no {tool} on this machine",
                        "run the daemon with `basal-local serve --detach` (then `basal-local stop`) instead",
                        status=1)
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise UserError(f"`{' '.join(argv)}` did not run ({exc.__class__.__name__})",
                        "run the daemon with `basal-local serve --detach` instead", status=1) from None
    if done.returncode != 0:
        said = (done.stderr.strip() or done.stdout.strip() or f"exit status {done.returncode}").splitlines()[0]
        if "Failed to connect to bus" in said or "System has not been booted with systemd" in said:
            raise UserError(f"`service {what}` needs a systemd user session, and there is none here ({said})",
                            "run the daemon with `basal-local serve --detach` (then `basal-local stop`) instead",
                            status=1)
        raise UserError(f"`{' '.join(argv)}` failed: {said}", "`basal-local service logs` shows the daemon's log",
                        status=1)
    return done


def control(kind: str, action: str, path: Path) -> list[list[str]]:
    """The manager's commands for start, stop and restart."""
    if kind == "systemd":
        reload = ["systemctl", "--user", "daemon-reload"]  # the unit file may have been rewritten by install
        return [reload, ["systemctl", "--user", action, "basal-local"]] if action != "stop" else \
            [["systemctl", "--user", "stop", "basal-local"]]
    target = f"gui/{os.getuid()}/{LABEL}"
    return {"start": [["launchctl", "load", "-w", str(path)]],
            "stop": [["launchctl", "unload", str(path)]],
            "restart": [["launchctl", "kickstart", "-k", target]]}[action]


def logs(kind: str, args: argparse.Namespace, log_file: Path) -> int:
    """The journal on Linux when journalctl is there, else the log file (`basal-local logs`)."""
    if kind == "systemd" and shutil.which("journalctl"):
        argv = ["journalctl", "--user", "-u", "basal-local", "--no-pager"]
        if args.lines:
            argv += ["-n", str(args.lines)]
        if args.follow:
            argv.append("-f")
        try:
            return subprocess.run(argv).returncode
        except KeyboardInterrupt:
            return 0  # -f ends with Ctrl-C

    return logs_command(args)


def service_command(args: argparse.Namespace) -> int:

    kind = platform_kind() if not getattr(args, "kind", None) else args.kind
    path = unit_path(kind)
    log_file = home_dirs()["logs"] / "basal-local.log"
    if args.action in ("start", "stop", "restart"):
        if not path.exists():
            raise UserError(f"no service installed ({path} does not exist)",
                            "add one first: basal-local service install --model mini", status=1)
        for argv in control(kind, args.action, path):
            manage(kind, argv, args.action)
        done = {"start": "started", "stop": "stopped", "restart": "restarted"}[args.action]
        print(f"basal-local: {done} the service ({' '.join(control(kind, args.action, path)[-1])})")
        if args.action != "stop":
            print("  `basal-local service status` says if it runs, `basal-local service logs -f` follows it")
        return 0
    if args.action == "logs":  # no service: no journal of it; the daemon's own log file then
        return logs(kind if path.exists() else "none", args, log_file)
    if args.action == "install":
        argv = serve_argv(args)

        models = args.model or load_settings(argparse.Namespace()).models
        if not models:
            raise UserError("no model for the service to serve",
                            "give one: basal-local service install --model mini (or set models in config.toml)")
        for ref in models:  # a service whose model is missing would only fail at every start
            model_path(ref)
        text = render(kind, argv, log_file)
        if args.dry_run:
            print(text, end="")
            return 0
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
        print(f"basal-local: wrote {path}")
        if kind == "systemd":
            print("  start it now and at every log-in:\n"
                  "    systemctl --user daemon-reload && systemctl --user enable --now basal-local\n"
                  "  or only now: basal-local service start  (stop, restart, logs -f the same way)\n"
                  f"  logs: journalctl --user -u basal-local -f   (and {log_file})")
        else:
            print(f"  start it now and at every log-in:\n    launchctl load -w {path}   (or: basal-local service start)\n"
                  f"  logs: {log_file}")
        return 0
    if args.action == "uninstall":
        if not path.exists():
            print(f"basal-local: no service installed ({path} does not exist)")
            return 0
        stop = (["systemctl", "--user", "disable", "--now", "basal-local"] if kind == "systemd"
                else ["launchctl", "unload", "-w", str(path)])
        stopped = False
        if shutil.which(stop[0]):
            try:
                stopped = subprocess.run(stop, capture_output=True, timeout=30).returncode == 0
            except (OSError, subprocess.TimeoutExpired):
                stopped = False
        path.unlink()
        print(f"basal-local: removed {path} " + (f"(stopped with `{' '.join(stop)}`)" if stopped else
                                                  f"(`{' '.join(stop)}` did not run here: a daemon it started may "
                                                  "still run; `basal-local status` / `ps` show it)"))
        return 0
    # status
    if not path.exists():
        print(f"basal-local: no service installed ({path}); `basal-local service install --model mini` adds one")
        return 1
    print(f"basal-local: service file {path}")
    state = "unknown"
    if kind == "systemd" and shutil.which("systemctl"):
        done = subprocess.run(["systemctl", "--user", "is-active", "basal-local"], capture_output=True, text=True,
                              timeout=10)
        state = done.stdout.strip() or done.stderr.strip() or state
        if "Failed to connect to bus" in state or "not been booted with systemd" in state:
            state = "unknown: no systemd user session here (`basal-local serve --detach` runs without one)"
    elif kind == "launchd" and shutil.which("launchctl"):
        done = subprocess.run(["launchctl", "list", LABEL], capture_output=True, text=True, timeout=10)
        state = "loaded" if done.returncode == 0 else "not loaded"
    print(f"  state: {state}\n  logs: {log_file}")
    return 0

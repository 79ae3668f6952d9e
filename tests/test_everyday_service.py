"""`basal-local service start|stop|restart|logs` over the installed user service, with fake systemctl, journalctl
and launchctl on PATH that record how they were called; without a service manager, one sentence and exit 1."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from .test_cli import assert_user_error, cli

FAKE = """#!/bin/sh
echo "$(basename "$0") $*" >> "$FAKE_CALLS"
if [ -n "$FAKE_SAY" ]; then echo "$FAKE_SAY" >&2; fi
if [ "$(basename "$0")" = journalctl ]; then echo "journal line 1"; echo "journal line 2"; fi
exit "${FAKE_RC:-0}"
"""


@pytest.fixture
def fakes(tmp_path, home, tiny_model) -> dict:
    """A PATH holding only the fake tools (and sh), and an installed systemd unit."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("systemctl", "journalctl", "launchctl"):
        path = bin_dir / tool
        path.write_text(FAKE)
        path.chmod(path.stat().st_mode | stat.S_IXUSR)
    (bin_dir / "basename").symlink_to("/usr/bin/basename")
    env = {**home, "PATH": f"{bin_dir}:/bin", "FAKE_CALLS": str(tmp_path / "calls"), "FAKE_RC": "0", "FAKE_SAY": ""}
    assert cli("service", "install", "--model", str(tiny_model), env=env).returncode == 0
    return env


def _calls(env: dict) -> list[str]:
    path = Path(env["FAKE_CALLS"])
    calls = path.read_text().splitlines() if path.exists() else []
    path.unlink(missing_ok=True)
    return calls


def test_start_stop_restart_run_systemctl_on_the_user_unit(fakes):
    _calls(fakes)
    done = cli("service", "start", env=fakes)
    assert done.returncode == 0 and "started the service" in done.stdout, done.stderr
    assert _calls(fakes) == ["systemctl --user daemon-reload", "systemctl --user start basal-local"]
    assert cli("service", "stop", env=fakes).returncode == 0
    assert _calls(fakes) == ["systemctl --user stop basal-local"]
    assert cli("service", "restart", env=fakes).returncode == 0
    assert _calls(fakes) == ["systemctl --user daemon-reload", "systemctl --user restart basal-local"]


def test_logs_read_the_journal(fakes):
    _calls(fakes)
    done = cli("service", "logs", "-n", "50", env=fakes)
    assert done.returncode == 0, done.stderr
    assert _calls(fakes) == ["journalctl --user -u basal-local --no-pager -n 50"]
    cli("service", "logs", "-f", env=fakes)
    assert _calls(fakes) == ["journalctl --user -u basal-local --no-pager -f"]


def test_a_refusal_of_systemctl_is_two_lines_exit_1(fakes):
    fakes = {**fakes, "FAKE_RC": "1", "FAKE_SAY": "Failed to start basal-local.service: Unit not found."}
    done = cli("service", "start", env=fakes)
    assert_user_error(done, "failed: Failed to start basal-local.service: Unit not found.", "service logs")
    assert done.returncode == 1
    fakes = {**fakes, "FAKE_SAY": "Failed to connect to bus: No medium found"}
    done = cli("service", "restart", env=fakes)
    assert_user_error(done, "needs a systemd user session", "serve --detach")
    assert done.returncode == 1


def test_without_systemd_one_sentence_and_exit_1(fakes, tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    env = {**fakes, "PATH": str(empty)}
    for action in ("start", "stop", "restart"):
        done = cli("service", action, env=env)
        assert_user_error(done, f"`service {action}` needs systemd, and there is no systemctl on this machine",
                          "serve --detach")
        assert done.returncode == 1
    # logs without journalctl: the log file (none yet here: said as such)
    done = cli("service", "logs", env=env)
    assert_user_error(done, "no log yet")


@pytest.mark.parametrize("rc, said", [("0", "stopped with `systemctl --user disable --now basal-local`"),
                                       ("1", "did not run here")])
def test_uninstall_says_whether_it_stopped_the_service(fakes, rc, said):
    """It said `stopped with systemctl ...` also where systemctl failed (no user session) or was missing."""
    done = cli("service", "uninstall", env={**fakes, "FAKE_RC": rc, "FAKE_SAY": "Failed to connect to bus"})
    assert done.returncode == 0 and said in done.stdout, done.stdout
    assert _calls(fakes) == ["systemctl --user disable --now basal-local"]


def test_logs_without_an_installed_service_read_the_log_file(home):
    """No unit: no journal of it (journalctl printed "-- No entries --" and exit 0); the daemon's log file then."""
    done = cli("service", "logs", env=home)
    assert_user_error(done, "no log yet")
    assert done.returncode == 1


def test_start_without_an_installed_service(home):
    done = cli("service", "start", env=home)
    assert_user_error(done, "no service installed", "service install --model mini")
    assert done.returncode == 1


def test_launchd_start_stop_restart(fakes, tmp_path, monkeypatch):
    """The same actions through launchctl (the macOS agent), the kind forced as on a Mac."""
    import argparse

    from basal_local.commands import service

    monkeypatch.setenv("HOME", str(tmp_path / "mac"))
    for key in ("PATH", "FAKE_CALLS", "FAKE_RC", "FAKE_SAY"):
        monkeypatch.setenv(key, fakes[key])
    plist = service.unit_path("launchd")
    plist.parent.mkdir(parents=True)
    plist.write_text("<plist/>")
    _calls(fakes)
    for action in ("start", "stop", "restart"):
        args = argparse.Namespace(action=action, kind="launchd", follow=False, lines=0)
        assert service.service_command(args) == 0
    assert _calls(fakes) == [f"launchctl load -w {plist}", f"launchctl unload {plist}",
                             f"launchctl kickstart -k gui/{os.getuid()}/dev.basal-local.daemon"]

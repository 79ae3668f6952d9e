"""Implementations of the `basal-local` subcommands; `basal_local/cli.py` holds the parser and dispatch.

Every module here reports a user's mistake by raising `UserError` (cause + fix, one or two lines); the
dispatcher prints it and exits non-zero, so nobody sees a traceback for something they can fix.
"""

from __future__ import annotations

import errno
import json
import os
import socket
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

DEFAULT_URL = "http://127.0.0.1:8000"


class UserError(Exception):
    """A mistake the user can fix: `cause` says what is wrong, `fix` what to do (printed as two lines)."""

    def __init__(self, cause: str, fix: str = "", status: int = 2) -> None:
        super().__init__(cause)
        self.cause, self.fix, self.status = cause, fix, status

    def lines(self) -> list[str]:
        out = [f"basal-local: error: {self.cause}"]
        if self.fix:
            out.append(f"  {self.fix}")
        return out


def check_url(url: str, flag: str = "--url") -> str:
    """A daemon's root URL with scheme, host and port; refuse `localhost:8000` and friends with the fix."""
    url = url.strip().rstrip("/")
    parsed = urllib.parse.urlsplit(url)
    if parsed.scheme not in ("http", "https") or not parsed.netloc:
        guess = "http://" + url.split("://", 1)[-1]
        raise UserError(f"{flag} {url!r} is not an http(s) URL", f"write the scheme too, e.g. {flag} {guess}")
    try:
        parsed.port  # noqa: B018 -- raises on a port that is not a number
    except ValueError:
        raise UserError(f"{flag} {url!r} has an invalid port", f"e.g. {flag} {DEFAULT_URL}") from None
    if parsed.path not in ("", "/") or parsed.query:
        root = f"{parsed.scheme}://{parsed.netloc}"
        raise UserError(f"{flag} {url!r} has a path: the tools add the endpoint themselves",
                        f"give the daemon's root address: {flag} {root}")
    return url


KEY_HINT = "give it with --api-key KEY or BASAL_LOCAL_API_KEY=KEY (the key the daemon was started with)"


def auth_headers(api_key: str | None) -> dict[str, str]:
    """The header our tools send a daemon started with --api-key (none without a key)."""
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def key_refused(url: str, api_key: str | None) -> UserError:
    """A 401 said as what it is: no key sent, or the wrong one."""
    if api_key:
        return UserError(f"the daemon at {url} refused the API key (401)", KEY_HINT)
    return UserError(f"the daemon at {url} requires an API key (401)", KEY_HINT)


def get_json(url: str, path: str, timeout: float = 10.0, flag: str = "--url", api_key: str | None = None) -> Any:
    """GET a daemon endpoint; an unreachable daemon is a UserError that says how to start one."""
    try:
        req = urllib.request.Request(url + path, headers=auth_headers(api_key))
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return json.loads(resp.read())
    except urllib.error.HTTPError as err:
        try:
            body = json.loads(err.read())
        except Exception:
            body = {}
        if err.code == 401:
            raise key_refused(url, api_key) from None
        if err.code == 503:
            what = body.get("error") or "it is still loading its models"
            raise UserError(f"the daemon at {url} is not ready: {what}",
                            "wait for `ready:` in its output, or look at its log") from None
        raise UserError(f"{url}{path} answered HTTP {err.code}: {body.get('error', err.reason)}",
                        f"is {url} a basal-local daemon? (`{flag}` names it)") from None
    except (urllib.error.URLError, OSError, ValueError) as exc:
        reason = getattr(exc, "reason", exc)
        raise UserError(f"cannot reach a daemon at {url} ({reason})",
                        f"start one with `basal-local serve`, or point {flag} at the right address") from None


def listen_error(host: str, port: int) -> UserError | None:
    """Why the daemon could not listen on `host:port` now, as the error to show; None where it can (the daemon's
    own check before it prints its banner)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        if os.name != "nt":
            # as uvicorn does: a port in TIME_WAIT is free, a listening socket still makes bind fail.
            # (On Windows SO_REUSEADDR would let us bind over a listener, so it stays off there.)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as exc:
            return _bind_failure(host, port, exc)
    return None


def port_free(host: str, port: int) -> bool:
    return listen_error(host, port) is None


def _bind_failure(host: str, port: int, exc: OSError) -> UserError:
    where = "127.0.0.1 (this machine only) or 0.0.0.0 (every network interface)"
    if isinstance(exc, socket.gaierror):
        return UserError(f"--host {host}: no address of that name ({exc.strerror or exc})", f"give --host {where}")
    if exc.errno == errno.EADDRINUSE:
        return UserError(f"port {port} on {host} is already in use (another program, or a basal-local already "
                         "running: `basal-local ps`)", f"choose another with --port, e.g. --port {port + 1}")
    if exc.errno == errno.EADDRNOTAVAIL:
        return UserError(f"--host {host} is not an address of this machine", f"give --host {where}")
    if exc.errno == errno.EACCES:
        return UserError(f"not allowed to listen on port {port} on {host} (ports below 1024 need administrator "
                         "rights)", "choose a port from 1024 up, e.g. --port 8000")
    return UserError(f"cannot listen on {host} port {port}: {exc.strerror or exc}", "check --host and --port")


def human_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000.0
    return f"{n:.1f} TB"


def model_path(ref: str, flag: str = "--model") -> Path:
    """A model directory from a path, `mini|4.5B|max`, `owner/name[@rev]` in the HF cache, or `basal-demo`."""
    # numpy and the tokenizers library (~0.15 s): not on the path of `basal-local -h` and the client commands
    from ..model.directory import ModelLoadError, load_model_dir
    from ..model.registry import DEMO_NAME, ModelNotFound, demo_model_dir, resolve_model

    if ref == DEMO_NAME:
        return demo_model_dir()
    try:
        path = resolve_model(ref)
    except ModelNotFound as exc:
        raise UserError(str(exc)) from None
    try:
        load_model_dir(path, check_weights=False)
    except ModelLoadError as exc:
        raise UserError(f"{path} is not a Basal model directory: {exc}",
                        f"give {flag} a folder holding config.json, basal.json, tokenizer.json and "
                        "model.safetensors (`basal-local list` shows the downloaded ones)") from None
    return path


def bind_ephemeral(host: str) -> socket.socket:
    """A listening socket on a port the system picks (--port 0)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.bind((host, 0))
    except OSError as exc:
        sock.close()
        raise _bind_failure(host, 0, exc) from None
    sock.listen(2048)
    return sock

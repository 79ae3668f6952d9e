"""What a local observer may see (SECURITY.md): the dashboard token, and error records without request content.

Any program on the machine can reach a loopback daemon. Counts, timings and ids are for everyone; a request's
questions and answers (`/api/requests/{id}`) and logged bodies (`--log-bodies` on `/api/events`) only for a client
that shows the daemon's dashboard token (a file only its user can read) or, when one is set, the API key.
"""

from __future__ import annotations

import hmac
import logging
import os
import secrets
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from ..paths import home_dirs

TOKEN_HEADER = "x-basal-dashboard-token"
# set on a log record (`extra=`) whose message carries request content: only privileged event streams get it
PRIVATE = "basal_private"
log = logging.getLogger(__name__)


def token_path(port: int) -> Path:
    return home_dirs()["state"] / f"dashboard-{port}.token"


def write_token(port: int) -> str:
    """A fresh token in a file readable by this user only (0600); a daemon that cannot write it still serves."""
    token = secrets.token_urlsafe(24)
    path = token_path(port)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as fh:
            fh.write(token)
        os.replace(tmp, path)
    except OSError as exc:
        log.warning("cannot write the dashboard token %s (%s): dashboards will not see questions and answers",
                    path, exc.strerror or exc)
    return token


def remove_token(port: int, token: str) -> None:
    path = token_path(port)
    try:
        if path.read_text() == token:  # never another daemon's file on the same port
            path.unlink()
    except OSError:
        pass


def read_token(url: str) -> str | None:
    """The token of the daemon at `url` (for `basal-local top` and `serve --tui`), if this user can read it."""
    try:
        port = urlsplit(url).port or 80
        return token_path(port).read_text().strip() or None
    except (OSError, ValueError):
        return None


def privileged(headers: Any, token: str, api_key: str | None) -> bool:
    """Whether a request may see request content: the dashboard token, or a key-protected daemon (the guard
    already refused every request without the key)."""
    if api_key:
        return True
    given = headers.get(TOKEN_HEADER)
    return bool(token) and given is not None and hmac.compare_digest(given.encode("utf-8", "replace"),
                                                                     token.encode("utf-8"))


def error_summary(body: Any) -> str:
    """An error answer as its codes only: its messages, inputs and paths (question ids) may quote the request."""
    if isinstance(body, dict):
        if isinstance(body.get("detail"), list):
            kinds = [d.get("type") for d in body["detail"] if isinstance(d, dict)][:5]
            return "; ".join(k[:40] if isinstance(k, str) else "error" for k in kinds) or "error"
        if isinstance(body.get("detail"), dict) and isinstance(body["detail"].get("error_type"), str):
            return body["detail"]["error_type"][:80]
        code = body.get("code") or (body.get("error") if isinstance(body.get("error"), dict) else None)
        if isinstance(code, str):
            return code[:80]
        if isinstance(code, dict) and isinstance(code.get("code"), str):
            return code["code"][:80]
    return "error"

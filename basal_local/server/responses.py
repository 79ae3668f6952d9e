"""The JSON response of the daemon's routes: UTF-8 without ASCII escapes, `application/json`."""

from __future__ import annotations

import json
from typing import Any

from litestar import Response


def json_response(status: int, body: Any, headers: dict[str, str] | None = None) -> Response:
    content = json.dumps(body, ensure_ascii=False).encode("utf-8")
    return Response(content=content, status_code=status, media_type="application/json", headers=headers or {})


def client_request_id(value: str | None) -> str | None:
    """A client's X-Request-Id as we echo it and name its record by: up to 128 printable ASCII characters, else
    none (a 70 KB id echoed in two headers broke the client's own header parser)."""
    if value and len(value) <= 128 and value.isascii() and value.isprintable():
        return value
    return None


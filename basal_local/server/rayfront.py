"""The ingress deployment of `serve --ray` ("BasalFront", server/rayserve.py): it reads a request's body, runs the
exchange on an engine replica through a deployment handle, passes the answer to Ray's proxy, and retries on
another replica when the first one died before answering (a decision is a pure function of its body). Only when
every try failed does it answer itself: a 503 in the path's dialect shape.

Ray is imported only inside functions: it is an optional extra.
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

from ..api.errors import dialect_of, http_error

log = logging.getLogger("basal_local.ray")
RETRIES = 3  # tries on other replicas after the first one died mid-request
RETRY_PAUSE_S = 0.2
STREAMED_PATHS = ("/api/events",)  # the daemon's only streaming answer (SSE); everything else is one unary call
SCOPE_KEYS = ("type", "asgi", "http_version", "method", "scheme", "path", "raw_path", "query_string", "headers",
              "client", "server")


class Front:
    """Reads a request, runs it on an engine replica, retries on another one when that replica died."""

    def __init__(self, engine, max_body_bytes: int, body_timeout_s: float) -> None:
        self.engine = engine
        self.streaming = engine.options(stream=True)
        self.max_body_bytes = max_body_bytes
        self.body_timeout_s = body_timeout_s

    def __serve_build_asgi_app__(self):
        return _Asgi(self.asgi)

    async def asgi(self, scope: dict[str, Any], receive, send) -> None:
        if scope["type"] == "lifespan":
            await _lifespan(receive, send)
            return
        if scope["type"] != "http":
            return  # no websockets here
        read = await _read_body(receive, self.max_body_bytes, self.body_timeout_s)
        if read is None:
            return  # the client left while sending its body
        body, complete = read
        plain = {k: scope[k] for k in SCOPE_KEYS if k in scope}
        plain["headers"] = [(bytes(k), bytes(v)) for k, v in scope.get("headers", [])]
        plain["root_path"] = ""
        streamed = plain.get("path", "") in STREAMED_PATHS
        for attempt in range(RETRIES + 1):
            started = False
            try:
                if streamed:
                    async for message in self.streaming.exchange.remote(plain, body, complete):
                        started = True
                        await send(_own_request_id(message))
                else:
                    messages = await self.engine.exchange_whole.remote(plain, body, complete)
                    started = True
                    for message in messages:
                        await send(_own_request_id(message))
                return
            except Exception as exc:
                if started or not _replica_died(exc):
                    raise  # mid-answer, or not a lost replica: Ray's proxy closes or answers 500
                log.warning("an engine replica died before answering %s %s (try %d of %d): %s",
                            scope.get("method"), scope.get("path"), attempt + 1, RETRIES + 1, type(exc).__name__)
                await asyncio.sleep(RETRY_PAUSE_S * (attempt + 1))
        await _send_unavailable(send, scope.get("path", ""))


def _own_request_id(message: dict[str, Any]) -> dict[str, Any]:
    """Ray's proxy puts its own x-request-id (the same value: the app echoes the one the proxy put on the request)
    on every answer; one copy is enough."""
    if message["type"] != "http.response.start":
        return message
    return {**message, "headers": [(k, v) for k, v in message.get("headers", []) if k.lower() != b"x-request-id"]}


class _Asgi:
    """An ASGI 3 callable around a bound method (uvicorn, which runs the lifespan, takes a bound method whose
    `__call__` is not a coroutine function for ASGI 2)."""

    def __init__(self, handler) -> None:
        self.handler = handler

    async def __call__(self, scope, receive, send) -> None:
        await self.handler(scope, receive, send)


def _replica_died(exc: BaseException) -> bool:
    """A replica's actor died or became unreachable (possibly wrapped in a task error)."""
    from ray.exceptions import RayActorError

    seen = 0
    while exc is not None and seen < 5:
        if isinstance(exc, RayActorError):
            return True
        exc = getattr(exc, "cause", None) or exc.__cause__
        seen += 1
    return False


async def _lifespan(receive, send) -> None:
    while True:
        message = await receive()
        if message["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
        elif message["type"] == "lifespan.shutdown":
            await send({"type": "lifespan.shutdown.complete"})
            return


async def _read_body(receive, limit: int, timeout_s: float) -> tuple[bytes, bool] | None:
    """(body, complete) from the proxy; None when the client left. Reading stops one byte past `limit` (the
    engine's body reader then answers 413) or at `timeout_s` (it then waits its own timeout and answers 408)."""
    parts: list[bytes] = []
    size = 0

    async def read() -> bool:
        nonlocal size
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return False
            chunk = message.get("body", b"")
            parts.append(chunk)
            size += len(chunk)
            if not message.get("more_body", False) or size > limit:
                return True

    try:
        async with asyncio.timeout(timeout_s):
            if not await read():
                return None
        return b"".join(parts), True
    except TimeoutError:
        return b"".join(parts), False


async def _send_unavailable(send, path: str) -> None:
    err = http_error(503, "UNAVAILABLE", f"no engine replica could answer ({RETRIES + 1} tries); retry shortly",
                     dialect_of(path), {"retry-after": "1"})
    body = json.dumps(err.body).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    headers += [(k.encode(), v.encode()) for k, v in (err.headers or {}).items()]
    await send({"type": "http.response.start", "status": err.status, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})

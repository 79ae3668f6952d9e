"""The only place the dashboard talks to the daemon: `GET /api/stats`, `GET /api/events` (SSE), request details.

`DaemonClient.run(sink)` keeps going until cancelled: it reads the stats snapshot, follows the event stream
from the snapshot's sequence number (so nothing between the two is missed) and polls the snapshot for the
queue and memory figures. When the daemon goes away it tells the sink, waits and tries again, resuming the
stream with `Last-Event-ID` where the daemon still has the events.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any, Protocol

import httpx

from .. import __version__
from ..telemetry.privacy import TOKEN_HEADER, read_token

USER_AGENT = f"basal-local-top/{__version__}"


class Sink(Protocol):
    """What receives the data (the app)."""

    def daemon_stats(self, snapshot: dict[str, Any]) -> None: ...

    def daemon_event(self, event: dict[str, Any]) -> None: ...

    def daemon_connection(self, connected: bool, error: str = "") -> None: ...


class Source(Protocol):
    """Anything that feeds a dashboard: the live client, or canned data in tests."""

    url: str

    async def run(self, sink: Sink) -> None: ...

    async def request(self, request_id: str) -> dict[str, Any] | None: ...


def parse_sse(lines: list[str]) -> dict[str, Any] | None:
    """One SSE message (its lines, without the blank line) -> the JSON object of its `data:` lines."""
    data = [line[5:].lstrip(" ") if line.startswith("data:") else None for line in lines]
    payload = "\n".join(d for d in data if d is not None)
    if not payload:
        return None  # a comment (keepalive) or an id-only message
    return json.loads(payload)


async def iter_sse(lines: AsyncIterator[str]) -> AsyncIterator[dict[str, Any]]:
    message: list[str] = []
    async for line in lines:
        if line == "":
            event = parse_sse(message)
            message = []
            if event is not None:
                yield event
        elif not line.startswith(":"):
            message.append(line)


class DaemonClient:
    def __init__(self, url: str, stats_every_s: float = 1.0, retry_s: float = 1.0, api_key: str | None = None) -> None:
        self.url = url.rstrip("/")
        self.stats_every_s = stats_every_s
        self.retry_s = retry_s
        self.last_seq: int | None = None
        headers = {"user-agent": USER_AGENT}
        if api_key:
            headers["authorization"] = f"Bearer {api_key}"
        token = read_token(self.url)  # the daemon's own dashboards see questions and answers (SECURITY.md)
        if token:
            headers[TOKEN_HEADER] = token
        self._http = httpx.AsyncClient(base_url=self.url, headers=headers,
                                       timeout=httpx.Timeout(5.0, read=None))

    async def stats(self) -> dict[str, Any]:
        response = await self._http.get("/api/stats", timeout=5.0)
        response.raise_for_status()
        return response.json()

    async def request(self, request_id: str) -> dict[str, Any] | None:
        try:
            response = await self._http.get(f"/api/requests/{request_id}", timeout=15.0)
        except httpx.HTTPError:
            return None
        return response.json() if response.status_code == 200 else None

    async def _follow(self, sink: Sink) -> None:
        headers = {"accept": "text/event-stream"}
        if self.last_seq is not None:
            headers["last-event-id"] = str(self.last_seq)
        async with self._http.stream("GET", "/api/events", headers=headers) as response:
            response.raise_for_status()
            async for event in iter_sse(response.aiter_lines()):
                if event.get("seq"):
                    self.last_seq = int(event["seq"])
                sink.daemon_event(event)
        raise httpx.ReadError("the daemon closed the event stream")

    async def _poll(self, sink: Sink) -> None:
        while True:
            await asyncio.sleep(self.stats_every_s)
            sink.daemon_stats(await self.stats())

    async def run(self, sink: Sink) -> None:
        while True:
            try:
                snapshot = await self.stats()
                daemon_seq = int(snapshot.get("last_seq", 0))
                if self.last_seq is None or daemon_seq < self.last_seq:  # first time, or a restarted daemon
                    self.last_seq = daemon_seq
                sink.daemon_stats(snapshot)
                sink.daemon_connection(True)
                tasks = [asyncio.ensure_future(self._follow(sink)), asyncio.ensure_future(self._poll(sink))]
                try:
                    done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
                    for task in done:
                        task.result()  # raises what ended it
                finally:
                    for task in tasks:
                        task.cancel()
                    await asyncio.gather(*tasks, return_exceptions=True)
            except (httpx.HTTPError, OSError, ValueError) as exc:
                sink.daemon_connection(False, _reason(exc))
                await asyncio.sleep(self.retry_s)

    async def aclose(self) -> None:
        await self._http.aclose()


def _reason(exc: Exception) -> str:
    if isinstance(exc, httpx.ConnectError):
        return "connection refused (is the daemon running?)"
    if isinstance(exc, httpx.HTTPStatusError):
        if exc.response.status_code == 401:
            return "HTTP 401: the daemon wants its API key (--api-key KEY or BASAL_LOCAL_API_KEY)"
        return f"HTTP {exc.response.status_code}"
    return str(exc) or type(exc).__name__

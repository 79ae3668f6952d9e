"""The daemon's HTTP protocol: uvicorn's (httptools, else h11) with what uvicorn does not offer.

- A client that half-closes after a complete request is answered: asyncio closes the transport on EOF unless
  `eof_received` returns True, so `printf 'POST ...' | nc -N` would never read its answer. EOF in the middle of a
  body is still the client going away.
- Malformed HTTP gets a JSON 400 (`{"error", "code"}`), as every other error outside the dialects.
- A connection must start a request (complete headers) within `header_timeout_s` of opening, or of its last
  answer plus the keep-alive time, else it is closed: uvicorn has no header timeout, so a client sending half a
  header line would hold a connection forever.
- A lingering close: an answer sent before the request's body was read (401 without the key, 413 from the
  Content-Length, 403, 415) used to close the socket with the unread body in its receive buffer, and the kernel
  then resets the connection: a client that sends its whole body before reading (http.client, requests, most
  SDKs) saw "connection reset by peer" instead of the answer once the body was over ~1-4 MiB. Now the answer is
  sent, the write side shut (FIN), and the rest of the body read and dropped, up to `LINGER_BYTES` and while it
  keeps coming (`LINGER_QUIET_S` between pieces, `LINGER_MAX_S` in all), then the socket closes cleanly; a
  body beyond those bounds is still cut with a reset (nginx's `lingering_close` does the same).
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

LINGER_BYTES = 64 * 1024 * 1024  # twice the default body limit: the rest of a body past it is cut
LINGER_QUIET_S = 5.0  # a client that stops sending for this long is closed
LINGER_MAX_S = 30.0  # at most this long per connection


class _LingeringTransport:
    """The asyncio transport as uvicorn sees it; `close()` lingers while the request body is still coming."""

    def __init__(self, transport: asyncio.Transport, protocol: Any) -> None:
        self._transport = transport
        self._protocol = protocol

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)

    def is_closing(self) -> bool:
        return self._protocol._lingering or self._transport.is_closing()

    def close(self) -> None:
        if self._protocol._lingering:
            return
        cycle = getattr(self._protocol, "cycle", None)
        unread = (cycle is not None and cycle.more_body and not self._protocol._peer_eof
                  and not self._protocol._shutting_down)
        if not unread or self._transport.is_closing() or not self._transport.can_write_eof():
            self._transport.close()
            return
        self._protocol._start_lingering()


def guarded_protocol(protocol_class: type, header_timeout_s: float, keep_alive_s: float) -> type:
    """The HTTP protocol class with the changes in the module's docstring."""

    class GuardedProtocol(protocol_class):  # type: ignore[misc, valid-type]
        _peer_eof = False
        _header_timer = None
        _lingering = False
        _linger_timer = None
        _linger_bytes = 0
        _linger_until = 0.0
        _shutting_down = False

        def connection_made(self, transport) -> None:
            super().connection_made(_LingeringTransport(transport, self))
            self._arm_header_timer(header_timeout_s)

        def _arm_header_timer(self, delay: float) -> None:
            waiting_for = getattr(self, "cycle", None)

            def expire() -> None:
                if getattr(self, "cycle", None) is waiting_for and not self.transport.is_closing():
                    self.transport.close()  # no new request started in time

            if self._header_timer is not None:
                self._header_timer.cancel()
            self._header_timer = asyncio.get_running_loop().call_later(delay, expire)

        # ---- the lingering close -----------------------------------------------------------------------------
        def _start_lingering(self) -> None:
            self._lingering = True
            if self._header_timer is not None:
                self._header_timer.cancel()
            raw = self.transport._transport
            raw.write_eof()  # the answer, then FIN: the client reads it whatever it still sends
            raw.resume_reading()  # uvicorn paused reading when its body buffer filled
            loop = asyncio.get_running_loop()
            self._linger_until = loop.time() + LINGER_MAX_S
            self._arm_linger(loop)

        def _arm_linger(self, loop) -> None:
            if self._linger_timer is not None:
                self._linger_timer.cancel()
            delay = max(0.0, min(LINGER_QUIET_S, self._linger_until - loop.time()))
            self._linger_timer = loop.call_later(delay, self._end_lingering)

        def _end_lingering(self) -> None:
            if self._linger_timer is not None:
                self._linger_timer.cancel()
            self.transport._transport.close()

        def data_received(self, data: bytes) -> None:
            if not self._lingering:
                super().data_received(data)
                return
            self._linger_bytes += len(data)  # the rest of a refused body: read and dropped
            if self._linger_bytes > LINGER_BYTES:
                self._end_lingering()
            else:
                self._arm_linger(asyncio.get_running_loop())

        def shutdown(self) -> None:
            self._shutting_down = True  # the daemon stops: no connection lingers past it
            if self._lingering:
                self._end_lingering()
            super().shutdown()

        def connection_lost(self, exc) -> None:
            for timer in (self._header_timer, self._linger_timer):
                if timer is not None:
                    timer.cancel()
            super().connection_lost(exc)

        def eof_received(self):
            if self._lingering:  # the client sent all of it: close now
                self._end_lingering()
                return True
            cycle = getattr(self, "cycle", None)
            if cycle is not None and not cycle.response_complete and not cycle.more_body:
                self._peer_eof = True
                return True  # keep the write side open for the answer
            return super().eof_received()

        def send_400_response(self, msg: str) -> None:
            # malformed HTTP: the JSON error shape of every path outside the dialects, not the parser's plain text
            body = json.dumps({"error": f"malformed HTTP request ({msg.rstrip('.')})", "code": "BAD_REQUEST"})
            self.transport.write(b"HTTP/1.1 400 Bad Request\r\ncontent-type: application/json\r\n"
                                 b"content-length: %d\r\nconnection: close\r\n\r\n%s"
                                 % (len(body), body.encode("ascii")))
            self.transport._transport.close()  # the parser cannot find where a body would end: no lingering

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if self.transport.is_closing():
                return
            if self._peer_eof:
                self.transport.close()
            else:
                self._arm_header_timer(keep_alive_s + header_timeout_s)

    GuardedProtocol.__name__ = f"Guarded{protocol_class.__name__}"
    return GuardedProtocol


def http_protocol(header_timeout_s: float, keep_alive_s: float) -> type:
    try:  # httptools, uvicorn's faster parser, is an optional package
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol as base
    except ImportError:  # httptools is optional; uvicorn then parses with h11
        from uvicorn.protocols.http.h11_impl import H11Protocol as base
    return guarded_protocol(base, header_timeout_s, keep_alive_s)

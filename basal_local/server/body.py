"""Reading a request body: size limits, a read deadline, and decompression that is capped and off the loop.

The body is read from the raw ASGI channel, so a stalled client (half a body, then nothing) is answered
408 and closed after `body_timeout_s`, a `Content-Length` above the limit is refused before anything is
read, and a client that goes away mid-body is reported as `ClientGone` (one INFO line, counted cancelled),
never as a failure. Compressed bodies are decompressed in a worker thread, in pieces, and refused (413) as
soon as the output passes the limit: a small bomb never expands in full.
"""

from __future__ import annotations

import asyncio
import io
import time
import zlib
from collections.abc import Awaitable, Callable
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import Any

import zstandard

MiB = 1024 * 1024
ENCODINGS = ("identity", "gzip", "zstd")
_PIECE = 1 * MiB  # decompressed bytes produced per step
# compressed bytes fed per step: what a member's end copies (the decompressor's unused_data) is at most this, so
# many tiny members cost linear time, not the rest of the body once per member
_FEED = 16 * 1024
MAX_MEMBERS = 4096  # gzip members / zstd frames of one body (a client sends one; a body of 200,000 cost seconds)


@dataclass
class BodyLimits:
    max_body_bytes: int = 32 * MiB  # before and after decompression
    body_timeout_s: float = 10.0  # the whole body must arrive within this


class BodyError(Exception):
    """A body that is refused: HTTP status, a stable code and a sentence for the user."""

    def __init__(self, status: int, code: str, message: str, close: bool = False) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message
        self.close = close  # the rest of the body was not read: the connection cannot be reused


class ClientGone(Exception):
    """The client disconnected before its body was complete."""


def check_headers(content_length: str | None, content_encoding: str | None, limits: BodyLimits) -> str:
    """Refuse what the headers alone show is wrong; returns the normalized encoding."""
    encoding = (content_encoding or "identity").strip().lower() or "identity"
    if encoding not in ENCODINGS:
        raise BodyError(415, "UNSUPPORTED_ENCODING",
                        f"unsupported Content-Encoding {encoding!r} (use identity, zstd or gzip)", close=True)
    if content_length is not None:
        try:
            length = int(content_length.strip())
        except ValueError:
            raise BodyError(400, "BAD_CONTENT_LENGTH", "Content-Length is not a number", close=True) from None
        if length > limits.max_body_bytes:
            raise BodyError(413, "BODY_TOO_LARGE", _too_large(limits, "the request body"), close=True)
    return encoding


def body_timeout(timeout_s: float) -> BodyError:
    """The 408 of a body that did not arrive in time (the connection is closed after it)."""
    return BodyError(408, "BODY_TIMEOUT", f"the request body did not arrive within {timeout_s:g} s", close=True)


def _too_large(limits: BodyLimits, what: str) -> str:
    return f"{what} is larger than the limit of {limits.max_body_bytes // MiB} MiB"


async def receive_body(receive: Callable[[], Awaitable[dict[str, Any]]], limits: BodyLimits) -> bytes:
    """All `http.request` chunks within the deadline and the size limit (raw, still encoded)."""
    deadline = time.monotonic() + limits.body_timeout_s
    chunks: list[bytes] = []
    total = 0
    while True:
        remaining = deadline - time.monotonic()
        try:
            if remaining <= 0:
                raise TimeoutError
            message = await asyncio.wait_for(receive(), remaining)
        except TimeoutError:
            raise body_timeout(limits.body_timeout_s) from None
        if message["type"] == "http.disconnect":
            raise ClientGone
        chunk = message.get("body", b"")
        total += len(chunk)
        if total > limits.max_body_bytes:
            raise BodyError(413, "BODY_TOO_LARGE", _too_large(limits, "the request body"), close=True)
        chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks)


def decompress(raw: bytes, encoding: str, limit: int) -> bytes:
    """The decoded body; 400 for a corrupt or truncated stream, 413 once the output passes `limit`."""
    if encoding == "identity":
        return raw
    try:
        if encoding == "gzip":
            return _gunzip(raw, limit)
        return _unzstd(raw, limit)
    except BodyError:
        raise
    except Exception as exc:  # zlib.error, zstandard.ZstdError, EOFError: the stream is broken
        raise BodyError(400, "BAD_ENCODING", f"request body is not valid {encoding}: {exc}") from None


class _Feed:
    """A compressed body in pieces of at most _FEED bytes, member after member (gzip) or frame after frame (zstd)."""

    def __init__(self, raw: bytes, encoding: str) -> None:
        self.view, self.at, self.members, self.encoding = memoryview(raw), 0, 1, encoding

    def piece(self) -> memoryview:
        if self.at >= len(self.view):
            raise EOFError(f"the {self.encoding} stream is truncated")
        piece = self.view[self.at:self.at + _FEED]
        self.at += len(piece)
        return piece

    def member_ended(self, unused: int) -> bool:
        """A member ended `unused` bytes before the last piece's end: whether another one follows."""
        self.at -= unused
        if self.at >= len(self.view):
            return False
        self.members += 1
        if self.members > MAX_MEMBERS:
            kind = "members" if self.encoding == "gzip" else "frames"
            raise BodyError(400, "BAD_ENCODING", f"the {self.encoding} request body has more than {MAX_MEMBERS} "
                            f"{kind}; send it as one")
        return True


def _too_large_decoded(limit: int) -> BodyError:
    return BodyError(413, "BODY_TOO_LARGE", f"the decompressed request body is larger than the limit of "
                     f"{limit // MiB} MiB")


def _gunzip(raw: bytes, limit: int) -> bytes:
    out, feed = bytearray(), _Feed(raw, "gzip")
    while True:  # one decompressor per gzip member (concatenated members are one body)
        d = zlib.decompressobj(wbits=31)
        while not d.eof:
            data = feed.piece()
            while data and not d.eof:
                out += d.decompress(data, _PIECE)
                if len(out) > limit:
                    raise _too_large_decoded(limit)
                data = d.unconsumed_tail
        if not feed.member_ended(len(d.unused_data)):
            return bytes(out)


def _unzstd(raw: bytes, limit: int) -> bytes:
    # First pass: bounded reads, so a bomb stops at the limit (the reader cannot tell a cut-off frame).
    size = 0
    with zstandard.ZstdDecompressor().stream_reader(io.BytesIO(raw), read_across_frames=True) as reader:
        while piece := reader.read(_PIECE):
            size += len(piece)
            if size > limit:
                raise _too_large_decoded(limit)
    # Second pass, known to stay under the limit: frame by frame, so a truncated frame is an error.
    out, feed = bytearray(), _Feed(raw, "zstd")
    while True:
        d = zstandard.ZstdDecompressor().decompressobj()
        while not d.eof:
            out += d.decompress(feed.piece())
        if not feed.member_ended(len(d.unused_data)):
            return bytes(out)


async def read_body(receive: Callable[[], Awaitable[dict[str, Any]]], content_length: str | None,
                    content_encoding: str | None, limits: BodyLimits, executor: Executor | None) -> bytes:
    """Check the headers, receive the body, decompress it in `executor`: the decoded bytes."""
    encoding = check_headers(content_length, content_encoding, limits)
    raw = await receive_body(receive, limits)
    if encoding == "identity":
        return raw
    loop = asyncio.get_running_loop()
    return await loop.run_in_executor(executor, decompress, raw, encoding, limits.max_body_bytes)

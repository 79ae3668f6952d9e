"""Raw-socket HTTP for the reliability tests: half bodies, half-close, lying headers, bounded waits."""

from __future__ import annotations

import json
import socket
import time


def request_bytes(method: str, path: str, body: bytes = b"", headers: dict[str, str] | None = None,
                  content_length: int | None = None, host: str = "127.0.0.1") -> bytes:
    """The bytes of one HTTP/1.1 request; `content_length` may lie about `body`."""
    merged = {"content-type": "application/json", **{k.lower(): v for k, v in (headers or {}).items()}}
    lines = [f"{method} {path} HTTP/1.1", f"Host: {merged.pop('host', host)}"]
    if method in ("POST", "PUT", "PATCH"):
        merged.setdefault("content-length", str(len(body) if content_length is None else content_length))
    lines += [f"{k}: {v}" for k, v in merged.items() if v is not None]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body


def connect(port: int, timeout: float = 10.0) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=timeout)
    sock.settimeout(timeout)
    return sock


def read_response(sock: socket.socket, deadline_s: float = 30.0) -> tuple[int, dict[str, str], bytes]:
    """(status, headers, body) of one response, read within a deadline (raises TimeoutError)."""
    end = time.monotonic() + deadline_s
    data = b""
    while b"\r\n\r\n" not in data:
        data += _recv(sock, end)
    head, rest = data.split(b"\r\n\r\n", 1)
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    headers = {}
    for line in lines[1:]:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    length = int(headers.get("content-length", "0"))
    while len(rest) < length:
        rest += _recv(sock, end)
    return status, headers, rest[:length]


def _recv(sock: socket.socket, end: float) -> bytes:
    remaining = end - time.monotonic()
    if remaining <= 0:
        raise TimeoutError("no complete response in time")
    sock.settimeout(remaining)
    chunk = sock.recv(65536)
    if not chunk:
        raise ConnectionError("connection closed before a complete response")
    return chunk


def closed_by_server(sock: socket.socket, deadline_s: float = 10.0) -> bool:
    """True once the server closes the connection (EOF or reset) within the deadline."""
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        try:
            sock.settimeout(max(0.01, end - time.monotonic()))
            if not sock.recv(65536):
                return True
        except (ConnectionResetError, BrokenPipeError):
            return True
        except TimeoutError:
            return False
    return False


def exchange(port: int, raw: bytes, half_close: bool = False, deadline_s: float = 30.0):
    """Send raw request bytes on a fresh connection; (status, headers, parsed JSON body)."""
    with connect(port, deadline_s) as sock:
        sock.sendall(raw)
        if half_close:
            sock.shutdown(socket.SHUT_WR)
        status, headers, body = read_response(sock, deadline_s)
    return status, headers, json.loads(body) if body else None


def post(port: int, path: str, body: bytes | dict, headers: dict[str, str] | None = None, **kw):
    data = json.dumps(body).encode() if isinstance(body, dict) else body
    return exchange(port, request_bytes("POST", path, data, headers), **kw)


def get(port: int, path: str, headers: dict[str, str] | None = None, host: str = "127.0.0.1", **kw):
    return exchange(port, request_bytes("GET", path, b"", headers, host=host), **kw)

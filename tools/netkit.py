"""Shared by tools/fuzz.py and tools/loadtest.py: start a daemon, raw HTTP exchanges with deadlines, RSS."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Daemon:
    """`basal-local serve` on a free port; its output is drained into `lines`."""

    def __init__(self, args: list[str], python: str = sys.executable, cwd: str | None = None) -> None:
        self.port = free_port()
        self.proc = subprocess.Popen([python, "-m", "basal_local.cli", "serve", "--port", str(self.port),
                                      *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=cwd)
        self.lines: list[str] = []
        threading.Thread(target=lambda: self.lines.extend(self.proc.stdout), daemon=True).start()

    def wait_ready(self, timeout: float = 600) -> None:
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError("daemon exited:\n" + "".join(self.lines))
            try:
                if exchange(self.port, request("GET", "/health"), 2)[0] == 200:
                    return
            except OSError:
                pass
            time.sleep(0.2)
        self.stop()
        raise TimeoutError("daemon did not become ready")

    def rss_mb(self) -> float:
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
        return 0.0

    def stop(self) -> int:
        self.proc.terminate()
        try:
            return self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()


def request(method: str, path: str, body: bytes = b"", headers: dict[str, str] | None = None,
            content_length: int | None = None) -> bytes:
    merged = {"host": "127.0.0.1", "content-type": "application/json",
              **{k.lower(): v for k, v in (headers or {}).items()}}
    if method == "POST":
        merged.setdefault("content-length", str(len(body) if content_length is None else content_length))
    head = [f"{method} {path} HTTP/1.1"] + [f"{k}: {v}" for k, v in merged.items() if v is not None]
    return ("\r\n".join(head) + "\r\n\r\n").encode("latin-1") + body


def exchange(port: int, raw: bytes, deadline_s: float = 60.0, half_close: bool = False,
             hang_up: bool = False) -> tuple[int, dict[str, str], bytes]:
    """Send raw bytes; (status, headers, body). `hang_up`: close right after sending (status 0)."""
    end = time.monotonic() + deadline_s
    with socket.create_connection(("127.0.0.1", port), timeout=deadline_s) as sock:
        sock.sendall(raw)
        if hang_up:
            return 0, {}, b""
        if half_close:
            sock.shutdown(socket.SHUT_WR)
        data = b""
        while b"\r\n\r\n" not in data:
            data += _recv(sock, end)
        head, rest = data.split(b"\r\n\r\n", 1)
        lines = head.decode("latin-1").split("\r\n")
        headers = {k.strip().lower(): v.strip() for k, _, v in (x.partition(":") for x in lines[1:])}
        length = int(headers.get("content-length", "0"))
        while len(rest) < length:
            rest += _recv(sock, end)
        return int(lines[0].split()[1]), headers, rest[:length]


def _recv(sock: socket.socket, end: float) -> bytes:
    remaining = end - time.monotonic()
    if remaining <= 0:
        raise TimeoutError("no answer within the deadline (a hang)")
    sock.settimeout(remaining)
    chunk = sock.recv(1 << 16)
    if not chunk:
        raise ConnectionError("closed before a complete answer")
    return chunk


def sample_requests() -> list[dict]:
    lines = (ROOT / "assets" / "sample_requests.jsonl").read_text(encoding="utf-8").splitlines()
    items = [json.loads(line) for line in lines if line.strip()]
    for item in items:
        item.pop("id", None)
    return items


def env_ok() -> None:
    if not os.path.isdir(ROOT / "basal_local"):
        sys.exit("run from a basal-local checkout")

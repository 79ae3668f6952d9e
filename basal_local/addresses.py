"""How a daemon's address is written for its clients (stdlib only: the client commands import it, and so does
the server)."""

from __future__ import annotations


def http_url(host: str, port: int) -> str:
    """http://HOST:PORT as clients write it (an IPv6 address in brackets)."""
    return f"http://[{host}]:{port}" if ":" in host and not host.startswith("[") else f"http://{host}:{port}"


def local_url(host: str, port: int) -> str:
    """Where a client on this machine reaches a daemon bound to host:port (a wildcard address: the loopback)."""
    return http_url("127.0.0.1" if host in ("0.0.0.0", "", "::") else host, port)

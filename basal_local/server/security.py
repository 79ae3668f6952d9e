"""Who may talk to the daemon: Host allowlist, Origin check, API key, JSON-only POSTs (an ASGI wrapper).

A local daemon is reachable by every web page the user opens: a page can POST to localhost without a CORS
preflight if it sends a "simple" content type (text/plain, form-urlencoded, multipart), and DNS rebinding
lets a page on evil.example reach 127.0.0.1 under its own name. So, before any route runs:

- Host must be a loopback name, the bound name or a configured one (403), unless the daemon is bound to a
  wildcard address (0.0.0.0, ::), which already needs an API key or `--insecure-public`;
- Origin, when present, must be a loopback origin (any port) or a configured one (403);
- with an API key configured (`--api-key`, BASAL_LOCAL_API_KEY), `Authorization: Bearer KEY` or `X-Api-Key`
  must carry it (401), compared in constant time;
- `GET /health` stays open without the key (liveness probes and supervisors carry none, as under vLLM's key) but
  then says only `{"status": ...}`: the route reads `scope[UNAUTHENTICATED]`;
- a request with a body must be JSON (or no content type); curl's `-d` default (form-urlencoded) is taken
  only without an Origin header, i.e. never from a browser (415).

Every refusal is a JSON body in the shape of the path's dialect (`api.errors.http_error`).
"""

from __future__ import annotations

import hmac
import ipaddress
import json
import uuid
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

from ..api.errors import ApiError, dialect_of, http_error
from .responses import client_request_id

LOOPBACK_NAMES = {"localhost", "127.0.0.1", "::1"}
WILDCARD_HOSTS = {"0.0.0.0", "::", ""}
# curl -d sends this by default; a browser sends it only with an Origin header
CURL_DEFAULT_TYPE = "application/x-www-form-urlencoded"
BODY_METHODS = {"POST", "PUT", "PATCH"}
# paths answered without the API key, with their details withheld (the scope key the route reads)
OPEN_PATHS = {"/health"}
UNAUTHENTICATED = "basal_unauthenticated"


def is_loopback(host: str) -> bool:
    """localhost, 127.0.0.0/8 or ::1 (the names a daemon on this machine alone is reached by)."""
    host = host.strip("[]").lower().rstrip(".")
    if host in LOOPBACK_NAMES or host.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def host_name(value: str) -> str:
    """The name part of a Host header (`[::1]:8000` -> `::1`, `Example.COM.:80` -> `example.com`)."""
    value = value.strip().lower()
    name, port = value, ""
    if value.startswith("["):
        end = value.find("]")
        if end > 0:
            name, port = value[1:end], value[end + 1:]
    elif value.count(":") == 1:
        name, port = value.split(":", 1)
        port = ":" + port
    if port and not (port.startswith(":") and port[1:].isdigit()):
        return value  # `[::1].evil`, `localhost:evil`: not a name and a port, so it matches no allowed name
    return name.rstrip(".")


def _origin(value: str) -> str:
    return value.strip().lower().rstrip("/")


@dataclass
class AccessPolicy:
    """What the guard lets in; built from the serve settings."""

    bind_host: str = "127.0.0.1"
    api_key: str | None = None
    allowed_hosts: set[str] = field(default_factory=set)  # "*" = any
    allowed_origins: set[str] = field(default_factory=set)  # "*" = any

    @classmethod
    def build(cls, bind_host: str, api_key: str | None, hosts: Iterable[str] = (),
              origins: Iterable[str] = ()) -> AccessPolicy:
        return cls(bind_host, api_key or None, {host_name(h) if h != "*" else h for h in hosts},
                   {_origin(o) for o in origins})

    @property
    def checks_host(self) -> bool:
        return "*" not in self.allowed_hosts and self.bind_host not in WILDCARD_HOSTS

    def host_allowed(self, host: str | None) -> bool:
        if not self.checks_host or host is None:  # HTTP/1.0 without Host: no browser sends that
            return True
        name = host_name(host)
        return is_loopback(name) or name == host_name(self.bind_host) or name in self.allowed_hosts

    def origin_allowed(self, origin: str | None) -> bool:
        if origin is None or "*" in self.allowed_origins:
            return True
        if _origin(origin) in self.allowed_origins:
            return True
        parts = urlsplit(origin.strip())
        try:
            parts.port  # noqa: B018  (raises on `localhost.:80.evil`: a malformed origin matches nothing)
        except ValueError:
            return False
        return (parts.scheme in ("http", "https") and bool(parts.hostname) and "@" not in parts.netloc
                and is_loopback(parts.hostname or ""))

    def key_ok(self, headers: dict[str, str]) -> bool:
        if not self.api_key:
            return True
        # either header may carry it ("Bearer KEY or X-Api-Key: KEY"): a wrong or empty one beside the right one
        # (an SDK's default header) does not shut the caller out
        auth = headers.get("authorization", "")
        given = [headers.get("x-api-key"), auth[7:].strip() if auth[:7].lower() == "bearer " else None]
        key = self.api_key.encode("utf-8")
        return any(g is not None and hmac.compare_digest(g.encode("utf-8"), key) for g in given)

    def check(self, method: str, path: str, headers: dict[str, str]) -> ApiError | None:
        """None if the request may go on, else the error to answer."""
        dialect = dialect_of(path)
        if not self.host_allowed(headers.get("host")):
            return http_error(403, "HOST_NOT_ALLOWED", f"Host {headers.get('host')!r} is not allowed (DNS "
                              "rebinding guard); start the daemon with --allowed-host NAME to allow it", dialect)
        origin = headers.get("origin")
        if not self.origin_allowed(origin):
            return http_error(403, "ORIGIN_NOT_ALLOWED", f"Origin {origin!r} is not allowed; start the daemon "
                              "with --allowed-origin ORIGIN to allow a web page to call it", dialect)
        if not self.key_ok(headers):
            return http_error(401, "UNAUTHORIZED", "missing or wrong API key: send 'Authorization: Bearer KEY' "
                              "or 'X-Api-Key: KEY'", dialect, {"www-authenticate": "Bearer"})
        if method in BODY_METHODS:
            ctype = headers.get("content-type", "").split(";", 1)[0].strip().lower()
            json_like = ctype in ("", "application/json") or (ctype.startswith("application/")
                                                               and ctype.endswith("+json"))
            upload = ctype == "multipart/form-data" and method == "POST" and path.rstrip("/") == "/v1/files"
            if not json_like and not upload and not (ctype == CURL_DEFAULT_TYPE and origin is None):
                return http_error(415, "UNSUPPORTED_MEDIA_TYPE", f"Content-Type {ctype!r} is not accepted: "
                                  "send the body as application/json", dialect)
        return None


async def send_error(send: Any, err: ApiError, close: bool = False, request_id: str | None = None) -> None:
    """Answer an ASGI request with an ApiError's JSON body (and `Connection: close` when asked), with the
    request id headers every response carries (the client's `x-request-id` echoed, else a new one)."""
    body = json.dumps(err.body, ensure_ascii=False).encode("utf-8")
    rid = (request_id or uuid.uuid4().hex).encode("latin-1")
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
               (b"x-request-id", rid), (b"x-typesafe-request-id", rid)]
    headers += [(k.encode("latin-1"), v.encode("latin-1")) for k, v in (err.headers or {}).items()]
    if close:
        headers.append((b"connection", b"close"))
    await send({"type": "http.response.start", "status": err.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


class Guard:
    """ASGI wrapper that applies an AccessPolicy to every HTTP request before routing."""

    def __init__(self, app: Any, policy: AccessPolicy) -> None:
        self.app = app
        self.policy = policy

    def __getattr__(self, name: str) -> Any:  # e.g. `.state` of the wrapped Litestar app
        return getattr(self.app, name)

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            headers: dict[str, str] = {}
            for key, value in scope.get("headers", []):
                name = key.decode("latin-1").lower()
                # a repeated Host/Origin/key header is ambiguous: keep the first (curl, browsers send one)
                headers.setdefault(name, value.decode("latin-1"))
            method, path = scope.get("method", "GET"), scope.get("path", "")
            err = self.policy.check(method, path, headers)
            if err is None and "transfer-encoding" in headers and "content-length" in headers:
                # RFC 9112 §6.3: a request framed both ways may be read differently by a proxy in front (request
                # smuggling); it is refused and its connection closed, not read as chunked and kept
                err = http_error(400, "AMBIGUOUS_LENGTH", "the request has both Transfer-Encoding and "
                                 "Content-Length; send one", dialect_of(path))
            if err is not None and err.status == 401 and method in ("GET", "HEAD") and path in OPEN_PATHS:
                scope[UNAUTHENTICATED], err = True, None
            if err is not None:
                # the body (if any) is not read: the connection cannot carry another request
                await send_error(send, err, close=scope.get("method") in BODY_METHODS,
                                 request_id=client_request_id(headers.get("x-request-id")))
                return
            if method == "HEAD":  # RFC 9110: HEAD wherever GET works (liveness probes: HEAD /health)
                await self.app({**scope, "method": "GET"}, receive, _headers_only(send))
                return
        await self.app(scope, receive, send)


def _headers_only(send: Any) -> Any:
    """`send` for a HEAD request answered as a GET: the status and headers (Content-Length included), no body."""
    async def send_head(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.body":
            if message.get("more_body", False):
                return
            message = {"type": "http.response.body", "body": b"", "more_body": False}
        await send(message)
    return send_head


def public_bind_refusal(host: str, api_key: str | None, insecure_public: bool) -> str | None:
    """Why the daemon must not start on `host`, or None: off loopback it needs a key or an explicit opt-in."""
    if is_loopback(host) or api_key or insecure_public:
        return None
    return (f"refusing to serve on {host!r} without an API key: anyone who can reach this machine could use it. "
            "Set one with --api-key KEY (or BASAL_LOCAL_API_KEY), or pass --insecure-public to serve without")

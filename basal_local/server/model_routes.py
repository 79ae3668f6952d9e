"""The routes of models at run time: `POST /api/load` and `POST /api/unload` over `models.ModelRegistry`.

Errors are the daemon's own shape, `{"error": sentence, "code": CODE}`: 400 `INVALID_JSON`, 422 `MODEL_REQUIRED`,
`UNKNOWN_FIELD`, `INVALID_WAIT`, `INVALID_KEEP_ALIVE`, 404 `MODEL_NOT_FOUND`, 409 `MODEL_LOADING` (an unload while
it loads), 500 `LOAD_FAILED`, 501 `NOT_AVAILABLE` (under `serve --ray`), 503 `LOADING` (the daemon's start-up models
are not in yet).
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

from litestar import Request, Response, post

from ..declare import parse_keep_alive
from .models import DRAIN_S, ModelRegistry
from .responses import json_response


def _fail(status: int, code: str, message: str) -> Response:
    return json_response(status, {"error": message, "code": code})


async def _body(request: Request) -> dict[str, Any] | Response:
    try:
        body = json.loads(await request.body() or b"null")
    except (ValueError, UnicodeDecodeError, RecursionError):  # RecursionError: nested too deeply
        return _fail(400, "INVALID_JSON", "the body must be a JSON object such as {\"model\": \"mini\"}")
    if not isinstance(body, dict) or not isinstance(body.get("model"), str) or not body["model"]:
        return _fail(422, "MODEL_REQUIRED", "the body must name a model: {\"model\": NAME}")
    unknown = sorted(set(body) - {"model", "keep_alive", "wait"})
    if unknown:
        return _fail(422, "UNKNOWN_FIELD", f"unknown field {unknown[0]!r} (known: model, keep_alive, wait)")
    if "wait" in body and not isinstance(body["wait"], bool):
        return _fail(422, "INVALID_WAIT", "wait must be true or false")
    return body


def _registry(request: Request) -> ModelRegistry | Response:
    state = request.app.state.basal
    if state.models is None and state.ready:
        return _fail(501, "NOT_AVAILABLE", "models cannot be loaded or unloaded at run time here (under serve "
                     "--ray each replica loads its models at start)")
    if state.models is None or not state.ready:
        return _fail(503, "LOADING", state.load_error or "the daemon is still loading its models")
    return state.models


async def _wait(registry: ModelRegistry, name: str, until: tuple[str, ...], timeout: float = 900.0) -> None:
    deadline = time.monotonic() + timeout
    while registry.entries[name].status not in until and time.monotonic() < deadline:
        await asyncio.sleep(0.05)


async def _registry_and_body(request: Request) -> tuple[ModelRegistry, dict[str, Any]] | Response:
    """The daemon's model registry and the route's JSON body, or the error answer for either (the registry's
    first)."""
    registry = _registry(request)
    body = await _body(request)
    if isinstance(registry, Response):
        return registry
    if isinstance(body, Response):
        return body
    return registry, body


def _state_of(registry: ModelRegistry, name: str) -> dict[str, Any]:
    return next(e for e in registry.snapshot() if e["name"] == name)


@post("/api/load", status_code=200)
async def load_route(request: Request) -> Response:
    asked = await _registry_and_body(request)
    if isinstance(asked, Response):
        return asked
    registry, body = asked
    try:
        keep: Any = parse_keep_alive(body["keep_alive"]) if "keep_alive" in body else "unchanged"
    except ValueError as exc:
        return _fail(422, "INVALID_KEEP_ALIVE", str(exc))
    loop = asyncio.get_running_loop()
    try:
        name, path = await loop.run_in_executor(None, registry.resolve, body["model"])
        if name is None:
            name = await loop.run_in_executor(None, registry.add, path)
    except LookupError as exc:
        return _fail(404, "MODEL_NOT_FOUND", str(exc))
    already = registry.entries[name].status == "loaded"
    registry.load(name, keep)
    registry.touch(name)
    if body.get("wait"):
        await _wait(registry, name, ("loaded", "failed", "unloaded"))
    entry = {**_state_of(registry, name), "already_loaded": already}
    if entry["status"] == "failed":
        return json_response(500, {**entry, "error": entry["error"], "code": "LOAD_FAILED"})
    return json_response(200 if entry["status"] == "loaded" else 202, entry)


@post("/api/unload", status_code=200)
async def unload_route(request: Request) -> Response:
    asked = await _registry_and_body(request)
    if isinstance(asked, Response):
        return asked
    registry, body = asked
    if "keep_alive" in body:
        return _fail(422, "UNKNOWN_FIELD", "unload takes no keep_alive")
    name = body["model"]
    name = request.app.state.basal.aliases.get(name, name)
    if name not in registry.entries:
        known = ", ".join(registry.entries) or "none"
        return _fail(404, "MODEL_NOT_FOUND", f"no model named {name!r} is known to this daemon (known: {known})")
    if registry.entries[name].status == "loading":
        return _fail(409, "MODEL_LOADING", f"model {name} is loading; unload it once it is loaded")
    thread = registry.unload(name)
    if thread is not None and body.get("wait"):  # its own end: a request may have started a new load since
        await asyncio.get_running_loop().run_in_executor(None, thread.join, DRAIN_S + 60.0)
    entry = _state_of(registry, name)
    done = thread is None and entry["status"] in ("unloaded", "failed") or thread is not None and not thread.is_alive()
    return json_response(200 if done else 202, {**entry, "unloaded": done})


MODEL_ROUTES = [load_route, unload_route]

"""What the daemon serves and how it is: `GET /v1/models` (the served models, and the known ones a request would
load), `GET /health` (ok | degraded | unavailable with each replica's state; the status word only without the API
key) and `GET /api/stats` (the telemetry snapshot, the replicas, the Batch API's jobs, admission, model states).
"""

from __future__ import annotations

from typing import Any

from litestar import Request, Response, get

from .. import __version__
from ..model.formats import port_summary
from .batch_routes import batch_summary
from .events import SERVER_ONLY, stats_snapshot
from .responses import json_response
from .security import UNAUTHENTICATED
from .state import AppState

DESCRIPTION = "basal typed-decision model (choice / noul / score / act / multi), Polish and English"


@get("/v1/models")
async def models(request: Request) -> Response:
    state: AppState = request.app.state.basal
    listed = {name: port_summary(engine.model) for name, engine in list(state.engines.items())}
    if state.models is not None:  # known and unloaded: a request for one loads it (server/models.py)
        listed.update(state.models.unloaded_listings())
    entries = [{"name": name, "release_date": state.release_date, "description": DESCRIPTION,
                "mode": f"basal-local-{state.backend_name}-{state.device}", "early_exit": [], **summary}
               for name, summary in listed.items()]
    return json_response(200, {"models": entries})


def replicas(state: AppState) -> list[dict[str, Any]]:
    """Every engine replica with its device and work (one per model unless --devices/--replicas)."""
    return [{k: v for k, v in r.items() if k not in SERVER_ONLY} for e in state.engines.values()
            for r in e.describe()]


def serving(state: AppState) -> tuple[str, list[dict[str, Any]]]:
    """ok | degraded (a replica is down, every model still has a live one) | unavailable (a model has none: its
    decisions answer 503), with the replicas' short entries."""
    entries = []
    for r in replicas(state):
        entry = {k: r[k] for k in ("model", "replica", "device", "alive")}
        entry["state"] = r.get("state", "ready" if r["alive"] else "down")
        for key in ("restarts", "exit_code", "restart_in_s"):
            if key in r:
                entry[key] = r[key]
        entries.append(entry)
    live = {e["model"] for e in entries if e["alive"]}
    if any(e["model"] not in live for e in entries):
        return "unavailable", entries
    return ("ok" if all(e["alive"] for e in entries) else "degraded"), entries


@get("/health")
async def health(request: Request) -> Response:
    state: AppState = request.app.state.basal
    if not state.ready:
        if request.scope.get(UNAUTHENTICATED):  # no API key (security.py): the status word only
            return json_response(503, {"status": "error" if state.load_error else "loading"})
        body: dict[str, Any] = {"status": "loading", "version": __version__}
        if state.load_error:
            body = {"status": "error", "error": state.load_error, "version": __version__}
        return json_response(503, body)
    word, entries = serving(state)
    failed = [e for e in (state.models.snapshot() if state.models else []) if e.get("status") == "failed"]
    if not state.engines and failed:  # nothing serves, and a model's load failed: not ok until one loads again
        word = "error"
    status, headers = (503, {"retry-after": "5"}) if word in ("unavailable", "error") else (200, {})
    if request.scope.get(UNAUTHENTICATED):
        return json_response(status, {"status": word}, headers)
    body = {"status": word, "version": __version__, "models": list(state.engines),
            "default_model": state.default_model, "backend": state.backend_name, "device": state.device,
            "dtype": state.dtype, "replicas": entries}
    if word == "error":
        body["error"] = "; ".join(f"model {e['name']} failed to load: {e.get('error')}" for e in failed)
    if word == "unavailable":
        down = sorted({e["model"] for e in entries} - {e["model"] for e in entries if e["alive"]})
        body["error"] = (f"no replica of {', '.join(down)} is serving; its decisions answer 503 until one is "
                         "back (`replicas` says each one's state)")
    return json_response(status, body, headers)


@get("/api/stats")
async def stats(request: Request) -> Response:
    state: AppState = request.app.state.basal
    snap = stats_snapshot(state)
    snap["replicas"] = replicas(state)
    snap["batch_jobs"] = batch_summary(request.app)  # the Batch API's ("batches" are the forwards)
    snap["admission"] = state.admission.snapshot()
    snap["model_states"] = state.models.snapshot() if state.models else []  # loading, unloading (models.py)
    return json_response(200, snap)


STATUS_ROUTES = [models, health, stats]

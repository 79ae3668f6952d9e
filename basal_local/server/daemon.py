"""Start the daemon: load models in the background (health says "loading"), then serve with uvicorn."""

from __future__ import annotations

import logging
import signal
import threading
from pathlib import Path

import uvicorn

from basal_local.backends.select import make_backend

from ..engine.engine import ModelEngine
from ..engine.gate import DeviceGate
from ..model.directory import load_model_dir
from .aliases import resolve_aliases
from .app import AppState, create_app
from .settings import Settings

log = logging.getLogger("basal_local.daemon")


def load_engines(state: AppState, settings: Settings, model_dirs: list[Path]) -> None:
    """Load every model (one gate for the device), then mark the state ready. Errors go to /health."""
    try:
        gate = DeviceGate(settings.engine.long_slice_ms / 1000.0)
        for i, path in enumerate(model_dirs, 1):
            log.info("loading model %d/%d from %s", i, len(model_dirs), path)
            model = load_model_dir(path)
            if model.name in state.engines:
                raise ValueError(f"two models are named {model.name!r} (basal.json name)")
            backend = make_backend(settings.backend, settings.device)
            info = backend.load(model.path, settings.dtype)
            state.backend_name, state.device, state.dtype = backend.name, backend.device, info.dtype
            engine = ModelEngine(model, backend, gate, state.telemetry, settings.engine)
            engine.start()
            state.engines[model.name] = engine
            log.info("loaded %s from %s: %d layers, %s on %s", model.name, path, info.layers, info.dtype,
                     backend.device)
        default = settings.default_model or next(iter(state.engines))
        if default not in state.engines:
            raise ValueError(f"default_model {default!r} is not one of the served models "
                             f"({', '.join(state.engines)})")
        state.default_model = default
        state.aliases = resolve_aliases(settings.aliases, list(state.engines), default)
        state.ready = True
        print(f"basal-local: ready: {', '.join(state.engines)} on {state.backend_name}/{state.device} "
              f"({state.dtype})", flush=True)
    except Exception as exc:
        log.debug("loading failed", exc_info=True)  # the sentence below is for the user; the trace for -v
        state.load_error = f"loading failed: {exc}"
        print(f"basal-local: error: {state.load_error}", flush=True)


class _Server(uvicorn.Server):
    """SIGINT/SIGTERM stop the daemon gracefully and exit 0 (uvicorn re-raises the signal after shutdown)."""

    def handle_exit(self, sig: int, frame) -> None:
        if self.should_exit and sig == signal.SIGINT:
            self.force_exit = True
        else:
            self.should_exit = True


def serve(settings: Settings, model_dirs: list[Path], banner: str = "") -> int:
    """Run until stopped; 0 after Ctrl-C/SIGTERM, 1 when a model failed to load (no daemon stuck at 503)."""
    state = AppState(max_inflight=settings.max_inflight, release_date=settings.release_date,
                     access_log=settings.access_log, metrics=settings.metrics)
    app = create_app(state)
    if settings.access_log:
        logging.getLogger("basal_local.server").setLevel(logging.INFO)
    config = uvicorn.Config(app, host=settings.host, port=settings.port, log_level="warning",
                            timeout_keep_alive=35, access_log=False)
    server = _Server(config)

    def load() -> None:
        load_engines(state, settings, model_dirs)
        if state.load_error:
            server.should_exit = True

    loader = threading.Thread(target=load, daemon=True)
    loader.start()
    if banner:
        print(banner, flush=True)
    try:
        server.run()
    finally:
        for engine in state.engines.values():
            engine.stop()
        print("basal-local: stopped", flush=True)
    if state.load_error or not server.started:
        return 1
    return 0

"""Start the daemon: load models in the background (health says "loading"), then serve with uvicorn."""

from __future__ import annotations

import asyncio
import json
import logging
import signal
import socket
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import uvicorn

from basal_local.backends.select import expand_devices, make_backend

from ..addresses import local_url
from ..api.errors import dialect_of, http_error
from ..engine.engine import ModelEngine, freeze_heap
from ..engine.gate import Admission, DeviceGate
from ..engine.protocol import Engine
from ..model.directory import load_model_dir
from ..replicas.front import HURRY, ProcessReplicaSet
from ..replicas.inprocess import ReplicaSet
from ..replicas.worker import WorkerSpec
from ..telemetry.privacy import remove_token, write_token
from .aliases import resolve_aliases
from .app import create_app
from .body import BodyLimits
from .events import BusLogHandler, close_streams
from .httpproto import http_protocol
from .models import ModelRegistry
from .output import guard_output
from .responses import client_request_id
from .security import AccessPolicy, Guard, is_loopback
from .settings import Settings
from .state import AppState

log = logging.getLogger("basal_local.daemon")
KEEP_ALIVE_S = 35  # SDKs keep idle connections for 30 s (tests/test_clients.py)


class Loader:
    """Loads one model directory into an Engine with the daemon's settings: at start (`load_engines`) and at run
    time (`server/models.py`). Models on the same device and replica slot share one gate and take turns."""

    def __init__(self, state: AppState, settings: Settings) -> None:
        self.state, self.settings = state, settings
        self.devices = expand_devices(settings.devices, settings.device)
        self.gates: dict[tuple[str, int], DeviceGate] = {}
        self.lock = threading.Lock()  # one model loads at a time: the gates, the state's device fields

    def __call__(self, path: Path) -> Engine:
        """The started engine of the model in `path` (not yet routed to)."""
        with self.lock:
            return self._load(path)

    def _load(self, path: Path) -> Engine:
        state, settings = self.state, self.settings
        model = load_model_dir(path)
        if model.name in state.engines:
            raise ValueError(f"two models are named {model.name!r} (basal.json name)")
        model_devices = settings.placement.get(model.name) or self.devices
        if use_processes(settings, model_devices):
            engine: Engine = _process_replicas(state, settings, model, model_devices)
            engine.start()
            return engine
        replicas = []
        for device in model_devices:
            for slot in range(settings.replicas):
                backend = make_backend(settings.backend, device, memory_limit=settings.gpu_memory,
                                       torch_options=settings.torch_options())
                info = backend.load(model.path, settings.dtype)
                state.backend_name, state.device, state.dtype = backend.name, backend.device, info.dtype
                gate = self.gates.setdefault((backend.device, slot),
                                             DeviceGate(settings.engine.long_slice_ms / 1000.0))
                replicas.append(ModelEngine(model, backend, gate, state.telemetry, settings.engine,
                                            replica=len(replicas), device_replicas=settings.replicas))
                log.info("loaded %s from %s: %d layers, %s on %s", model.name, path, info.layers, info.dtype,
                         backend.device)
        engine = replicas[0] if len(replicas) == 1 else ReplicaSet(replicas)
        state.telemetry.memory_probe = engine.memory
        engine.start()
        return engine


def load_engines(state: AppState, settings: Settings, model_dirs: list[Path], freeze: bool = False,
                 make_loader: Callable[[AppState, Settings], Callable[[Path], Engine]] = Loader,
                 run_time_models: bool = True) -> None:
    """Load every model on every device it is placed on (`replicas` engines per device, one gate per device and
    replica slot), then mark the state ready. Errors go to /health. `freeze` (the daemon's own process): take
    what was loaded out of the garbage collector's view (`freeze_heap`). `make_loader`: what turns a model
    directory into an Engine (`serve --ray`: one on a Ray deployment); `run_time_models`: whether /api/load and
    /api/unload work (not under Ray, whose replicas load their models at start)."""
    try:
        if settings.replicas < 1:
            raise ValueError(f"--replicas must be at least 1 (got {settings.replicas})")
        state.engine_settings = settings.engine
        loader = make_loader(state, settings)
        state.models = ModelRegistry(state, loader, settings.keep_alive_s, frozen=freeze)
        for i, path in enumerate(model_dirs, 1):
            log.info("loading model %d/%d from %s", i, len(model_dirs), path)
            engine = loader(path)
            state.engines = {**state.engines, engine.model.name: engine}
            state.models.loaded_at_start(engine)
        default = settings.default_model or next(iter(state.engines))
        if default not in state.engines:
            raise ValueError(f"default_model {default!r} is not one of the served models "
                             f"({', '.join(state.engines)})")
        state.default_model = default
        state.aliases = resolve_aliases(settings.aliases, list(state.engines), default)
        state.torch_options = settings.torch_options().product() if state.backend_name == "torch" else None
        if freeze:
            freeze_heap()
        if run_time_models:
            state.models.start()
        else:
            state.models.stop()
            state.models = None
        state.ready = True
        print(f"basal-local: ready: {', '.join(state.engines)} on {state.backend_name}/{state.device} "
              f"({state.dtype})", flush=True)
    except Exception as exc:
        log.debug("loading failed", exc_info=True)  # the sentence below is for the user; the trace for -v
        state.load_error = f"loading failed: {exc}"
        print(f"basal-local: error: {state.load_error}", flush=True)


def use_processes(settings: Settings, devices: list[str]) -> bool:
    """Replicas in worker processes: as asked, else when the model is on more than one GPU (on two H200s they
    served 332 req/s against 294 in one process, docs/SCALING.md); CPU and one-GPU replicas stay in-process."""
    if settings.replica_processes is not None:
        return settings.replica_processes
    return len({d for d in devices if d.startswith("cuda")}) > 1


def _process_replicas(state: AppState, settings: Settings, model, devices: list[str]) -> ProcessReplicaSet:
    """`--replica-processes`: one worker process per device and replica slot, loading side by side."""
    specs = [WorkerSpec(model.path, settings.backend, device, settings.dtype, settings.engine, replica=r,
                        log_level=logging.getLogger("basal_local").getEffectiveLevel(), gpu_memory=settings.gpu_memory,
                        torch_options=settings.torch_options(), device_replicas=settings.replicas)
             for r, (device, _) in enumerate((d, s) for d in devices for s in range(settings.replicas))]
    engine = ProcessReplicaSet(model, specs, state.telemetry, settings.engine)
    info = engine.wait_ready()
    state.backend_name, state.device, state.dtype = info.backend, info.device, info.dtype
    state.telemetry.memory_probe = engine.memory
    for r in engine.replicas:
        if r.info is not None:
            log.info("loaded %s from %s: %d layers, %s on %s (replica %d, pid %d)", model.name, model.path,
                     r.info.layers, r.info.dtype, r.info.device, r.replica, r.info.pid)
    return engine


class _Server(uvicorn.Server):
    """SIGINT/SIGTERM stop the daemon gracefully and exit 0 (uvicorn re-raises the signal after shutdown).

    Requests in flight get `drain_s` (uvicorn's graceful-shutdown timeout) and are then cancelled; a second
    signal stops at once.
    """

    def __init__(self, config: uvicorn.Config, state: AppState | None = None) -> None:
        super().__init__(config)
        self.state = state

    def handle_exit(self, sig: int, frame) -> None:
        if self.should_exit:
            self.force_exit = True
            if self.state is not None:
                self.state.stopped_at_once = True
            # stopping at once cancels the app's lifespan task, which uvicorn would log as an error with a traceback
            logging.getLogger("uvicorn.error").setLevel(logging.CRITICAL)
        else:
            self.should_exit = True

    async def shutdown(self, sockets=None) -> None:
        if self.state is not None:
            close_streams(self.state)  # dashboards' streams end first: the drain is for requests
        await super().shutdown(sockets)


class DrainGuard:
    """When `--drain` runs out, uvicorn cancels the requests still running and would answer each with a plain-text
    500 and a traceback: answer them 503 + Retry-After in the dialect's shape instead, with one log line each."""

    def __init__(self, app: Any, drain_s: float, state: AppState | None = None) -> None:
        self.app = app
        self.drain_s = drain_s
        self.state = state

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = False

        async def tracked(message: dict) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, tracked)
        except asyncio.CancelledError:
            headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope.get("headers", [])}
            request_id = client_request_id(headers.get("x-request-id")) or uuid.uuid4().hex
            why = ("a second signal stopped the daemon at once" if self.state is not None and
                   self.state.stopped_at_once else f"the drain ({self.drain_s:.0f} s) ran out")
            log.warning("request %s %s: still running when %s, answered 503", request_id, scope.get("path", ""), why)
            if started:
                return  # half an answer is already out: the connection closes
            err = http_error(503, "SHUTTING_DOWN", "the daemon is shutting down; retry (on its next start)",
                             dialect_of(scope.get("path", "")), {"retry-after": "5"})
            body = json.dumps(err.body, ensure_ascii=False).encode("utf-8")
            out = {**(err.headers or {}), "content-type": "application/json", "content-length": str(len(body)),
                   "connection": "close", "x-request-id": request_id}
            await send({"type": "http.response.start", "status": err.status,
                        "headers": [(k.encode("latin-1"), v.encode("latin-1")) for k, v in out.items()]})
            await send({"type": "http.response.body", "body": body})


def build(settings: Settings, model_dirs: list[Path], quiet: bool = False) -> tuple[AppState, uvicorn.Config]:
    """The daemon's state and its guarded app in a uvicorn config; `start_loading` then loads the models in the
    background (/health answers 503 until then). `quiet`: print nothing (the dashboard owns the screen)."""
    limits = BodyLimits(settings.max_body_mb * 1024 * 1024, settings.body_timeout_s)
    state = AppState(max_inflight=settings.max_inflight, release_date=settings.release_date,
                     access_log=settings.access_log, log_bodies=settings.log_bodies, limits=limits,
                     metrics=settings.metrics, admission=Admission(wait_s=settings.admission_wait_ms / 1000.0),
                     api_key_set=bool(settings.api_key))
    state.dashboard_token = write_token(settings.port)
    state.token_port = settings.port
    policy = AccessPolicy.build(settings.host, settings.api_key, settings.allowed_hosts, settings.allowed_origins)
    app = DrainGuard(Guard(create_app(state), policy), settings.drain_s, state)
    # INFO: the access log, disconnects mid-body, and the bodies when asked
    logging.getLogger("basal_local.server").setLevel(logging.INFO)
    if settings.insecure_public and not is_loopback(settings.host) and not settings.api_key:
        log.warning("serving on %s without an API key (--insecure-public): anyone who can reach this machine "
                    "can use the daemon", settings.host)
        if not quiet:
            print(f"basal-local: warning: serving on {settings.host} without an API key (--insecure-public): "
                  "anyone who can reach this machine can use the daemon", flush=True)
    if not quiet:  # quiet callers route every record to the log pane themselves
        logging.getLogger("basal_local").addHandler(BusLogHandler(state))  # the dashboards' log pane
    config = uvicorn.Config(app, host=settings.host, port=settings.port, log_level="warning",
                            timeout_keep_alive=KEEP_ALIVE_S, access_log=False,
                            http=http_protocol(settings.body_timeout_s, KEEP_ALIVE_S),
                            timeout_graceful_shutdown=max(1, round(settings.drain_s)),
                            **({"log_config": None} if quiet else {}))
    return state, config


def start_loading(state: AppState, settings: Settings, model_dirs: list[Path],
                  on_failure: Callable[[], None] | None = None, freeze: bool = False,
                  on_ready: Callable[[], None] | None = None, **loading: Any) -> threading.Thread:
    """Load the models in a background thread; `on_failure` runs when one fails (serve stops then), `on_ready`
    when all are loaded; `loading`: load_engines' `make_loader` and `run_time_models`."""

    def load() -> None:
        load_engines(state, settings, model_dirs, freeze, **loading)
        if state.load_error and on_failure is not None:
            on_failure()
        elif state.ready and on_ready is not None:
            on_ready()

    loader = threading.Thread(target=load, name="basal-local-loader", daemon=True)
    loader.start()
    return loader


def serve(settings: Settings, model_dirs: list[Path], banner: str = "", ready_text: str = "",
          sock: socket.socket | None = None, **loading: Any) -> int:
    """Run until stopped; 0 after Ctrl-C/SIGTERM, 1 when a model failed to load (no daemon stuck at 503).
    `ready_text` is printed once the models are loaded; `sock`: an already bound socket (--port 0); `loading`:
    load_engines' `make_loader` and `run_time_models` (`serve --ray`)."""
    state, config = build(settings, model_dirs)
    guard_output()  # after build: uvicorn's handlers exist now; a full disk under any output is one warning
    server = _Server(config, state)
    if threading.current_thread() is threading.main_thread():
        # from here a Ctrl-C or SIGTERM is a graceful stop, also before uvicorn installs its own handlers (the
        # KeyboardInterrupt there left its serve coroutine never awaited, which Python warns about)
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, server.handle_exit)

    def stop() -> None:
        server.should_exit = True

    if banner:  # first: the loader's log lines come after the line that says the models are loading
        print(banner, flush=True)
    start_loading(state, settings, model_dirs, stop, freeze=True,
                  on_ready=(lambda: print(ready_text, flush=True)) if ready_text else None, **loading)
    try:
        server.run(sockets=[sock] if sock is not None else None)
    finally:
        hurry_on_signals()
        shutdown(state)
        print("basal-local: stopped", flush=True)
    if state.load_error or not server.started:
        return 1
    return 0


class InThread:
    """The daemon (`build`'s guarded app, its models loading in the background) served by uvicorn in a thread of
    this process, for tools and tests that talk HTTP to a daemon and also reach into its engines (measure them,
    patch their routing). A user's daemon is `serve`, which owns the signals and the process."""

    def __init__(self, settings: Settings, model_dirs: list[Path]) -> None:
        self.port = settings.port
        self.url = local_url(settings.host, settings.port)
        self.state, config = build(settings, model_dirs, quiet=True)
        start_loading(self.state, settings, model_dirs)
        self.server = _Server(config, self.state)
        self.thread = threading.Thread(target=lambda: asyncio.run(self.server.serve()), name="basal-local-in-thread",
                                       daemon=True)
        self.thread.start()

    def wait_ready(self, timeout: float = 240.0) -> None:
        """Return once it serves with every model loaded; stop it and raise RuntimeError if a model fails to load
        or `timeout` passes first."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and not self.state.load_error:
            if self.server.started and self.state.ready:
                return
            time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"the daemon did not get ready: {self.state.load_error or 'timeout'}")

    def stop(self, timeout: float = 60.0) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=timeout)
        shutdown(self.state)


def hurry_on_signals() -> None:
    """While the engines stop, another Ctrl-C or SIGTERM kills the worker processes still running instead of
    killing this process (uvicorn's handlers are gone by now): it exited with -15 and left the forkserver, the
    resource tracker and a hung worker behind."""
    if threading.current_thread() is not threading.main_thread():
        return
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda signum, frame: HURRY.set())


def shutdown(state: AppState, timeout: float = 30.0) -> None:
    """Stop planning and every engine: queued requests fail with "engine stopped", lane threads are joined."""
    state.stopping = True
    if state.models is not None:
        state.models.stop()
    if state.dashboard_token:
        remove_token(state.token_port, state.dashboard_token)
    state.planner.shutdown(wait=False, cancel_futures=True)
    state.big_planner.shutdown(wait=False, cancel_futures=True)
    for name, engine in state.engines.items():
        if not engine.stop(timeout):
            log.warning("engine %s did not stop within %.0f s", name, timeout)

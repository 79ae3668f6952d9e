"""`basal-local serve --ray`: the daemon's own app on every replica of a Ray Serve deployment (several hosts).

Two deployments behind Ray Serve's HTTP proxy (docs/SCALING.md, "Several hosts: Ray Serve"):

- `EngineReplica` ("BasalEngine"): one replica per GPU actor (`num_gpus: 1`) or per CPU slot. Each builds what
  the daemon builds, `load_engines` and `Guard(create_app(state))`, and runs one HTTP exchange per call through
  that ASGI app, streaming the response back. The System One and Basal handlers, the guards, the error shapes
  and the headers are the daemon's own; nothing here answers a request itself except the one case below.
- `Front` ("BasalFront", the ingress, server/rayfront.py): reads the request body, hands the exchange to an engine replica through
  a deployment handle and passes the answer to Ray's proxy. As many fronts as engine replicas (one front was
  the ceiling at ~170 requests/s on two H200s, docs/SCALING.md). A decision's answer comes back in one unary
  call (its ASGI messages as one list); only the event stream (`GET /api/events`) is streamed message by
  message. When the replica's process dies before it
  answered, the front sends the same request to another replica (Ray's router skips dead replicas, and waits
  for a replacement when none is left). A decision is a pure function of its body, so a retry cannot double an
  effect. Only when every try failed does the front answer itself: a 503 in the path's dialect shape.

Ray is imported only inside functions: it is an optional extra (`pip install "basal-local[ray]"`).
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..model.registry import demo_model_dir, resolve_model
from .app import create_app
from .body import BodyLimits
from .daemon import load_engines, shutdown
from .rayfront import Front
from .security import AccessPolicy, Guard
from .settings import Settings
from .state import AppState

log = logging.getLogger("basal_local.ray")
APP_NAME = "basal-local"
# requests one engine replica takes at once: its own scheduler batches them (the daemon's --max-inflight
# still answers 529 beyond its limit); Ray's default of 5 would starve the batcher
ENGINE_MAX_ONGOING = 256
FRONT_MAX_ONGOING = 4096
# Ray Serve's own throughput mode for a local cluster (user code and router on the replica's main loop, request
# logs buffered, gRPC between Ray's proxy and the replicas), without its direct ingress, which would take the
# HTTP port away from Ray's proxy. A cluster we join keeps the settings it was started with (docs/SCALING.md).
LOCAL_CLUSTER_ENV = {"RAY_SERVE_THROUGHPUT_OPTIMIZED": "1", "RAY_SERVE_ENABLE_DIRECT_INGRESS": "0"}
NO_ACCESS_LOG = {"enable_access_log": False}  # the engine's app keeps its own access log (--access-log)
TARGET_ONGOING = 32  # autoscaling: requests in flight per replica that Ray Serve aims for
REPLICA_HEADER = b"x-basal-local-replica"  # which Ray replica answered (the only header the daemon lacks)


class RayUnavailable(Exception):
    """Ray cannot be used (not installed, no cluster at the address, a deployment that failed): a sentence
    and what to do about it."""

    def __init__(self, cause: str, fix: str = "") -> None:
        super().__init__(cause)
        self.cause, self.fix = cause, fix


@dataclass
class RayOptions:
    address: str | None = None  # None: start a local Ray cluster on this machine
    min_replicas: int = 1
    max_replicas: int | None = None  # None: min_replicas, or every GPU of the cluster when replicas use GPUs
    gpus: bool | None = None  # None: GPUs when the device is cuda, or auto on a cluster that has GPUs
    num_cpus: float | None = None  # a local cluster's CPUs (None: Ray counts them)
    fronts: int | None = None  # front replicas (None: as many as engine replicas, with the same bounds)
    health_check_period_s: float = 2.0


def import_ray():
    """(ray, ray.serve), or RayUnavailable naming the extra to install."""
    try:
        import ray
        from ray import serve
    except ImportError as exc:
        raise RayUnavailable(f"--ray needs Ray Serve, which is not installed here ({exc.name or exc} is missing)",
                             'install it: pip install "basal-local[ray]"') from None
    except Exception as exc:  # installed but broken, e.g. a dependency older than Ray's generated code needs
        raise RayUnavailable(f"Ray Serve is installed here but does not import: {_first_line(exc)}",
                             'reinstall it with its dependencies: pip install -U "basal-local[ray]"') from None
    return ray, serve


# ---------------------------------------------------------------- engine replica (runs in a Ray actor)

class EngineReplica:
    """One engine replica: the daemon's state and guarded app, loaded in the actor's constructor."""

    def __init__(self, settings: Settings, model_refs: list[str], demo: bool = False) -> None:
        logging.getLogger("basal_local.server").setLevel(logging.INFO)
        dirs = [Path(resolve_model(ref)) for ref in model_refs]  # names resolve in this node's model cache
        if demo:
            dirs.insert(0, demo_model_dir())
        self.state = AppState(max_inflight=settings.max_inflight, release_date=settings.release_date,
                              access_log=settings.access_log, log_bodies=settings.log_bodies,
                              limits=BodyLimits(settings.max_body_mb * 1024 * 1024, settings.body_timeout_s),
                              metrics=settings.metrics)
        load_engines(self.state, settings, dirs)
        if self.state.load_error:  # the replica fails to start; Ray reports it and `serve` prints it
            raise RuntimeError(self.state.load_error)
        self.state.models.stop()  # models at run time are one daemon's: under Ray each replica keeps its models
        self.state.models = None
        policy = AccessPolicy.build(settings.host, settings.api_key, settings.allowed_hosts,
                                    settings.allowed_origins)
        self.app = Guard(create_app(self.state), policy)
        self.replica_id = _replica_id()

    async def exchange(self, scope: dict[str, Any], body: bytes, complete: bool = True):
        """Run one HTTP exchange through the app; yield its ASGI response messages.

        `receive` hands over the body once and then waits for ever: the client's disconnect reaches the app as
        the cancellation of this call (Ray cancels it when the proxy's client goes away)."""
        messages: asyncio.Queue = asyncio.Queue()
        handed = False

        async def receive() -> dict[str, Any]:
            nonlocal handed
            if not handed:
                handed = True
                return {"type": "http.request", "body": body, "more_body": not complete}
            await asyncio.Event().wait()
            return {"type": "http.disconnect"}  # never reached: the call is cancelled first

        async def send(message: dict[str, Any]) -> None:
            await messages.put(message)

        task = asyncio.ensure_future(self.app(dict(scope), receive, send))
        try:
            while True:
                getter = asyncio.ensure_future(messages.get())
                done, _ = await asyncio.wait({getter, task}, return_when=asyncio.FIRST_COMPLETED)
                if getter not in done:
                    getter.cancel()
                    if messages.empty():
                        task.result()  # the app ended without finishing its answer: raise what it raised
                        return
                    continue
                message = getter.result()
                if message["type"] == "http.response.start":
                    message = {**message, "headers": [*message.get("headers", []),
                                                      (REPLICA_HEADER, self.replica_id.encode("latin-1"))]}
                yield message
                if message["type"] == "http.response.body" and not message.get("more_body", False):
                    return
        finally:
            if not task.done():
                task.cancel()

    async def exchange_whole(self, scope: dict[str, Any], body: bytes, complete: bool = True) -> list[dict]:
        """The same exchange, its messages as one list: one unary Ray call per request instead of a stream of
        objects (an answer that is not streamed is two messages anyway)."""
        return [message async for message in self.exchange(scope, body, complete)]

    def check_health(self) -> None:
        """Ray Serve's periodic probe: a replica whose models failed or that is stopping is replaced."""
        state = self.state
        if state is None or state.load_error or state.stopping or not state.ready:
            raise RuntimeError((state and state.load_error) or "the replica is not serving")

    def close(self) -> None:
        """Stop the engines (queued requests fail with "engine stopped"); called again, it does nothing."""
        state, self.state = getattr(self, "state", None), None
        if state is not None:
            shutdown(state, timeout=5.0)

    def __del__(self) -> None:  # Ray Serve deletes the replica's object when it takes the replica down
        self.close()


def _replica_id() -> str:
    try:
        from ray import serve

        return serve.get_replica_context().replica_id.unique_id
    except Exception:  # outside Ray (tests of the class itself)
        return f"local-{os.getpid()}"


# ---------------------------------------------------------------- building and running the application

def build_application(settings: Settings, model_refs: list[str], options: RayOptions, demo: bool = False,
                      gpus: bool = False):
    """The Ray Serve application: the front bound to the engine deployment."""
    _, serve = import_ray()
    engine_settings = Settings(**{**settings.__dict__, "device": "cuda" if gpus else "cpu", "devices": None,
                                  "replicas": 1, "placement": {}})
    maximum = options.max_replicas or options.min_replicas
    scaling: dict[str, Any]
    if maximum == options.min_replicas:
        scaling = {"num_replicas": options.min_replicas}
    else:
        scaling = {"autoscaling_config": {"min_replicas": options.min_replicas, "max_replicas": maximum,
                                          "target_ongoing_requests": TARGET_ONGOING}}
    engine = serve.deployment(
        EngineReplica, name="BasalEngine", max_ongoing_requests=ENGINE_MAX_ONGOING,
        ray_actor_options={"num_gpus": 1} if gpus else {"num_cpus": 1},
        health_check_period_s=options.health_check_period_s, health_check_timeout_s=30,
        logging_config=NO_ACCESS_LOG, **scaling,
    ).bind(engine_settings, model_refs, demo)
    # the fronts scale with the engines: each costs CPU per request (reading the body, one Ray call, passing the
    # answer on), which one process could not give to two H200s' worth of requests
    front_scaling = {"num_replicas": options.fronts} if options.fronts else scaling
    front = serve.deployment(serve.ingress()(Front), name="BasalFront", max_ongoing_requests=FRONT_MAX_ONGOING,
                             ray_actor_options={"num_cpus": 0}, logging_config=NO_ACCESS_LOG, **front_scaling)
    return front.bind(engine, settings.max_body_mb * 1024 * 1024, settings.body_timeout_s)


def model_refs_for_cluster(refs: list[str]) -> list[str]:
    """What each replica resolves: an existing directory as an absolute path (it must exist at that path on
    every node), anything else (mini, OWNER/NAME) as given, found in each node's own model cache."""
    out = []
    for ref in refs:
        path = Path(ref).expanduser()
        out.append(str(path.resolve()) if path.is_dir() else ref)
    return out


def connect(ray, options: RayOptions) -> bool:
    """Connect to the cluster at `options.address`, or start a local one; True when we started it."""
    if ray.is_initialized():
        return False
    kwargs: dict[str, Any] = {"include_dashboard": False, "logging_level": logging.WARNING,
                              "log_to_driver": False}
    if options.address:
        unreachable = _unreachable(options.address)
        if unreachable:  # ray.init would retry for minutes
            raise RayUnavailable(f"no Ray cluster reachable at {options.address} ({unreachable})",
                                 "start one there with `ray start --head`, or drop --ray-address to start one on "
                                 "this machine")
        try:
            ray.init(address=options.address, **kwargs)
        except (ConnectionError, RuntimeError, ValueError) as exc:
            raise RayUnavailable(f"no Ray cluster reachable at {options.address} ({_first_line(exc)})",
                                 "start one there with `ray start --head`, or drop --ray-address to start one on "
                                 "this machine") from None
        return False
    # Ray runs its workers at nice 15 by default; the engine replicas are the whole workload here, so they run
    # at the priority `basal-local serve` itself has (a local cluster only; a cluster's own settings stay)
    os.environ.setdefault("RAY_worker_niceness", "0")
    for key, value in LOCAL_CLUSTER_ENV.items():  # read by the controller, proxy and replicas it starts
        os.environ.setdefault(key, value)
    try:
        ray.init(num_cpus=options.num_cpus, **kwargs)
    except Exception as exc:
        raise RayUnavailable(f"could not start a local Ray cluster ({_first_line(exc)})",
                             "see /tmp/ray/session_latest/logs/raylet.out; a busy machine can miss Ray's start-up "
                             "deadlines, try again") from None
    return True


def _unreachable(address: str, timeout_s: float = 5.0) -> str | None:
    """Why HOST:PORT does not accept a connection, or None (also for `auto` and `ray://`, which Ray resolves)."""
    if address in ("auto", "local") or "://" in address:
        return None
    host, _, port = address.rpartition(":")
    if not host:
        host, port = address, "6379"
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s):
            return None
    except ValueError:
        return f"{port!r} is not a port"
    except OSError as exc:
        return exc.strerror or type(exc).__name__


def use_gpus(ray, settings: Settings, options: RayOptions) -> bool:
    if options.gpus is not None:
        return options.gpus
    if settings.device == "cuda":
        return True
    if settings.device == "auto":
        return ray.cluster_resources().get("GPU", 0) > 0
    return False


def serve_ray(settings: Settings, model_refs: list[str], options: RayOptions, demo: bool = False,
              banner: str = "") -> int:
    """Deploy on the cluster, print where it answers, wait for Ctrl-C/SIGTERM, then take it down.

    A local cluster started here is shut down with everything on it; on an existing cluster only this
    application is deleted (other Serve applications stay)."""
    ray, serve = import_ray()
    # SIGTERM while the cluster starts or the replicas load: unwind like Ctrl-C, through the clean-up below
    signal.signal(signal.SIGTERM, _interrupt)
    started = deploying = False
    try:
        started = connect(ray, options)
        gpus = use_gpus(ray, settings, options)
        if options.max_replicas is None and gpus:
            options.max_replicas = max(options.min_replicas, int(ray.cluster_resources().get("GPU", 0)))
        if options.max_replicas is not None and options.max_replicas < options.min_replicas:
            raise RayUnavailable(f"--max-replicas {options.max_replicas} is below --min-replicas "
                                 f"{options.min_replicas}", "give --max-replicas at least --min-replicas")
        if banner:
            print(banner, flush=True)
        deploying = True
        try:
            serve.start(http_options={"host": settings.host, "port": settings.port}, logging_config=NO_ACCESS_LOG)
            app = build_application(settings, model_refs_for_cluster(model_refs), options, demo, gpus)
            serve.run(app, name=APP_NAME, route_prefix="/", blocking=False)
        except RayUnavailable:
            raise
        except Exception as exc:
            raise RayUnavailable(f"the Ray Serve deployment failed: {_first_line(exc)}",
                                 "the replicas' logs are under /tmp/ray/session_latest/logs/serve/ on the nodes"
                                 ) from None
        kind = "GPU" if gpus else "CPU"
        scale = (f"{options.min_replicas}" if (options.max_replicas or options.min_replicas) == options.min_replicas
                 else f"{options.min_replicas}-{options.max_replicas}")
        print(f"basal-local: ready through Ray Serve: {scale} {kind} replica(s) behind "
              f"http://{settings.host}:{settings.port}", flush=True)
        _wait_for_signal()
        return 0
    finally:
        _take_down(ray, serve, started, deploying)
        if deploying:
            print("basal-local: stopped", flush=True)


def _take_down(ray, serve, started: bool, deployed: bool) -> None:
    """A local cluster started here goes entirely; on a cluster we joined, only our application (if we got as far
    as deploying it)."""
    try:
        if started:
            serve.shutdown()
        elif deployed:
            serve.delete(APP_NAME)
    except Exception as exc:  # the cluster may be gone already
        log.debug("taking the application down: %s", exc)
    if ray.is_initialized():
        ray.shutdown()


def _interrupt(*_) -> None:
    raise KeyboardInterrupt


def _wait_for_signal() -> None:
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    while not stop.wait(0.5):
        pass


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__

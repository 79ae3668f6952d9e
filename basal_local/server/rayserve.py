"""`basal-local serve --ray`: the daemon with its engines on the replicas of a Ray Serve deployment (several hosts).

This process is the front: the daemon's own server and app (`daemon.serve`: every route, guard, error body,
header, /api/stats, /metrics and the dashboard as without Ray), its engines `replicas.rayengine.RayEngine`s, one
per model, which plan each request here and send it through the deployment's handle to a replica. The
deployment, "BasalEngine" (`replicas.rayreplica.EngineReplica`), has one replica per GPU actor (`num_gpus: 1`)
or per CPU slot, each holding the served models' ModelEngines; Ray Serve scales it between --min-replicas and
--max-replicas, probes each replica and replaces one whose process died. Ray's HTTP proxy is not started: the
daemon listens on --host/--port itself (docs/SCALING.md, "Several hosts: Ray Serve").

Ray is imported only inside functions: it is an optional extra (`pip install "basal-local[ray]"`).
"""

from __future__ import annotations

import logging
import os
import signal
import socket
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

from ..addresses import http_url
from ..engine.protocol import Engine
from ..model.directory import load_model_dir
from ..replicas.rayengine import RayEngine
from ..replicas.rayreplica import EngineReplica, ReplicaSpec
from .daemon import serve
from .settings import Settings
from .state import AppState

log = logging.getLogger("basal_local.ray")
APP_NAME = "basal-local"
# requests one engine replica takes at once: its own scheduler batches them; Ray's default of 5 would starve
# the batcher (the front's --max-inflight answers 529 beyond its limit)
ENGINE_MAX_ONGOING = 256
# Ray Serve's own throughput mode for a local cluster (user code and router on the replica's main loop, request
# logs buffered), without its direct ingress (an HTTP port per replica: the daemon here is the only listener).
# A cluster we join keeps the settings it was started with (docs/SCALING.md).
LOCAL_CLUSTER_ENV = {"RAY_SERVE_THROUGHPUT_OPTIMIZED": "1", "RAY_SERVE_ENABLE_DIRECT_INGRESS": "0"}
NO_ACCESS_LOG = {"enable_access_log": False}  # the daemon keeps its own access log (--access-log)
TARGET_ONGOING = 32  # autoscaling: requests in flight per replica that Ray Serve aims for
FIRST_REPORT_S = 120.0  # how long the front waits for a replica's first report once the deployment runs


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
    health_check_period_s: float = 2.0


def import_ray():
    """(ray, ray.serve), or RayUnavailable naming the extra to install."""
    try:  # Ray is an optional extra (and ~1 s to import): only under --ray
        import ray
        from ray import serve
    except ImportError as exc:
        raise RayUnavailable(f"--ray needs Ray Serve, which is not installed here ({exc.name or exc} is missing)",
                             'install it: pip install "basal-local[ray]"') from None
    except Exception as exc:  # installed but broken, e.g. a dependency older than Ray's generated code needs
        raise RayUnavailable(f"Ray Serve is installed here but does not import: {_first_line(exc)}",
                             'reinstall it with its dependencies: pip install -U "basal-local[ray]"') from None
    return ray, serve


# ---------------------------------------------------------------- building and running the deployment

def build_application(settings: Settings, model_refs: list[str], options: RayOptions, demo: bool = False,
                      gpus: bool = False):
    """The Ray Serve application: the engine deployment alone (the front is this process, not a deployment)."""
    _, serve_api = import_ray()
    spec = replica_spec(settings, model_refs, demo, gpus)
    maximum = options.max_replicas or options.min_replicas
    scaling: dict[str, Any]
    if maximum == options.min_replicas:
        scaling = {"num_replicas": options.min_replicas}
    else:
        scaling = {"autoscaling_config": {"min_replicas": options.min_replicas, "max_replicas": maximum,
                                          "target_ongoing_requests": TARGET_ONGOING}}
    engine = serve_api.deployment(
        EngineReplica, name="BasalEngine", max_ongoing_requests=ENGINE_MAX_ONGOING,
        ray_actor_options={"num_gpus": 1} if gpus else {"num_cpus": 1},
        health_check_period_s=options.health_check_period_s, health_check_timeout_s=30,
        logging_config=NO_ACCESS_LOG, **scaling,
    )
    return engine.bind(spec)


def replica_spec(settings: Settings, model_refs: list[str], demo: bool = False, gpus: bool = False) -> ReplicaSpec:
    """What each replica loads, with the daemon's settings: one GPU of its node, or the CPU."""
    return ReplicaSpec(model_refs, settings.backend, "cuda" if gpus else "cpu", settings.dtype, settings.engine,
                       demo=demo, log_level=logging.getLogger("basal_local").getEffectiveLevel(),
                       gpu_memory=settings.gpu_memory, torch_options=settings.torch_options())


class RayLoader:
    """load_engines' loader under --ray: a model directory (here, for planning) -> a RayEngine on the deployment,
    once a replica reported that it serves the model."""

    def __init__(self, handle: Any, state: AppState, settings: Settings) -> None:
        self.handle, self.state, self.settings = handle, state, settings

    def __call__(self, path: Path) -> Engine:
        model = load_model_dir(path)
        engine = RayEngine(model, self.handle, self.state.telemetry, self.settings.engine)
        report = engine.first_report(FIRST_REPORT_S)
        if report is None or model.name not in report.models:
            engine.stop(5.0)
            raise RuntimeError(f"no replica of the Ray deployment reported serving {model.name} within "
                               f"{FIRST_REPORT_S:.0f} s" if report is None else
                               f"the Ray replicas do not serve {model.name} (they serve "
                               f"{', '.join(report.models)}): the same model must resolve on every node")
        self.state.backend_name, self.state.device, self.state.dtype = report.backend, report.device, report.dtype
        self.state.telemetry.memory_probe = engine.memory
        log.info("%s: on the Ray deployment (replica %s on %s)", model.name, report.replica_id, report.device)
        return engine


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


def serve_ray(settings: Settings, model_dirs: list[Path], options: RayOptions, demo: bool = False,
              banner: str = "", ready_text: str = "", sock: socket.socket | None = None) -> int:
    """Deploy the engine replicas on the cluster, then run the daemon here with Ray engines until Ctrl-C/SIGTERM;
    then take the deployment down. `model_dirs`: the models as this machine resolved them (the front plans with
    their tokenizers); each replica resolves `settings.models` in its own node's model cache.

    A local cluster started here is shut down with everything on it; on an existing cluster only this
    application is deleted (other Serve applications stay)."""
    ray, serve_api = import_ray()
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
            # no Ray HTTP proxy: the daemon below listens on --host/--port
            serve_api.start(proxy_location="Disabled", logging_config=NO_ACCESS_LOG)
            app = build_application(settings, model_refs_for_cluster(settings.models), options, demo, gpus)
            handle = serve_api.run(app, name=APP_NAME, route_prefix=None, blocking=False)
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
              f"{http_url(settings.host, settings.port)}", flush=True)
        return serve(settings, model_dirs, "", ready_text, sock, make_loader=partial(RayLoader, handle),
                     run_time_models=False)
    finally:
        _take_down(ray, serve_api, started, deploying)


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


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__

"""What the daemon's handlers share (`AppState`) and the body-size cap the app and the stats both report.

Its own module so that the handler modules (app, events, extras, metrics) all import it and none imports another.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from ..engine.engine import EngineSettings
from ..engine.gate import Admission
from ..engine.protocol import Engine
from ..telemetry import Telemetry
from .body import BodyLimits

MAX_BODY_BYTES = 32 * 1024 * 1024
# the ASGI scope key under which a decision's handler names the served model it routed to (/metrics labels)
SCOPE_MODEL = "basal.model"


@dataclass
class AppState:
    """What the handlers share: engines by served name, the in-flight counter, telemetry, readiness."""

    # replaced, never mutated, while serving (copy on write): handlers iterate it while the loader adds models
    engines: dict[str, Engine] = field(default_factory=dict)
    default_model: str | None = None
    max_inflight: int = 1024
    release_date: str = "2026-10-05"
    backend_name: str = ""
    device: str = ""
    dtype: str = ""
    telemetry: Telemetry = field(default_factory=Telemetry)
    # the engines' settings as loaded (shown in /api/stats), one set for every model
    engine_settings: EngineSettings = field(default_factory=EngineSettings)
    # the torch backend's product options as loaded (TorchOptions.product()); None on another backend
    torch_options: dict[str, Any] | None = None
    ready: bool = False
    load_error: str | None = None
    stopping: bool = False
    closing: bool = False  # shutdown began: event streams end now (server/events.py close_streams)
    stopped_at_once: bool = False  # a second Ctrl-C/SIGTERM: requests still running are cut, not drained
    event_streams: set[Callable[[], None]] = field(default_factory=set)  # one wake-up per open /api/events
    access_log: bool = False
    log_bodies: bool = False  # request content goes to the log only when asked (--log-bodies)
    dashboard_token: str = ""  # shown by the daemon's own dashboards to see request content (SECURITY.md)
    api_key_set: bool = False
    token_port: int = 0  # the port whose token file this daemon wrote (removed at shutdown)
    limits: BodyLimits = field(default_factory=BodyLimits)
    metrics: bool = False
    aliases: dict[str, str] = field(default_factory=dict)  # alias -> served name (server/aliases.py)
    inflight: int = 0  # mirrors admission.inflight for the stats
    admission: Admission = field(default_factory=Admission)
    lock: threading.Lock = field(default_factory=threading.Lock)
    planner: ThreadPoolExecutor = field(default_factory=lambda: ThreadPoolExecutor(4, "basal-plan"))
    big_planner: ThreadPoolExecutor = field(default_factory=lambda: ThreadPoolExecutor(2, "basal-plan-big"))
    metrics_recorder: Any = None  # metrics.MetricsRecorder when --metrics
    models: Any = None  # models.ModelRegistry once loading began: every known model's state (load/unload)

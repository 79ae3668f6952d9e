"""Daemon settings: CLI flags > environment > config.toml > defaults."""

from __future__ import annotations

import os
import tomllib
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from ..engine.engine import EngineSettings
from ..paths import APP, home_dirs  # noqa: F401  (re-exported: older imports use settings.home_dirs)


@dataclass
class Settings:
    models: list[str] = field(default_factory=list)
    host: str = "127.0.0.1"
    port: int = 8000
    backend: str = "auto"
    device: str = "auto"
    devices: str | None = None  # "cuda:0,cuda:1" or "all": one engine replica per device
    replicas: int = 1  # replicas per device (several on one big GPU, or on the CPU in tests)
    # each replica in its own worker process (engine/processes.py); None: when a model is on more than one GPU
    replica_processes: bool | None = None
    placement: dict[str, list[str]] = field(default_factory=dict)  # config.toml: model name -> its devices
    dtype: str = "auto"
    # --gpu-memory: a size (24GB) or a share (0.8) of each GPU's memory the models may use (backends/memory.py)
    gpu_memory: str | None = None
    default_model: str | None = None
    max_inflight: int = 1024
    admission_wait_ms: float = 100.0  # longest wait for a place before a 529 (engine/gate.py Admission)
    release_date: str = "2026-10-05"
    access_log: bool = False
    # who may call (server/security.py); a key is also read from BASAL_LOCAL_API_KEY
    api_key: str | None = None
    insecure_public: bool = False  # serve off loopback without a key (explicit opt-in)
    allowed_hosts: list[str] = field(default_factory=list)
    allowed_origins: list[str] = field(default_factory=list)
    log_bodies: bool = False  # request content in the log
    # limits (server/body.py); drain_s: how long SIGTERM waits for requests in flight
    max_body_mb: int = 32
    body_timeout_s: float = 10.0
    drain_s: float = 10.0
    metrics: bool = False
    # [aliases] in config.toml: extra names a request may use for a served model (jev-latest = "mini")
    aliases: dict[str, str] = field(default_factory=dict)
    engine: EngineSettings = field(default_factory=EngineSettings)

    @classmethod
    def load(cls, overrides: dict[str, Any], config_file: Path | None = None) -> Settings:
        """Defaults, then config.toml, then BASAL_LOCAL_* variables, then the given (CLI) overrides."""
        values: dict[str, Any] = {}
        path = config_file or config_path()
        if path.is_file():
            try:
                with open(path, "rb") as fh:
                    values.update(tomllib.load(fh))
            except tomllib.TOMLDecodeError as exc:
                raise ValueError(f"{path}: not valid TOML ({exc}); fix or remove the file") from None
        aliases = values.pop("aliases", {})
        if not isinstance(aliases, dict) or not all(isinstance(v, str) for v in aliases.values()):
            raise ValueError(f'{path}: [aliases] must map names to served model names (jev-latest = "mini")')
        env_map = {"BASAL_LOCAL_HOST": "host", "BASAL_LOCAL_PORT": "port", "BASAL_LOCAL_DEVICE": "device",
                   "BASAL_LOCAL_BACKEND": "backend", "BASAL_LOCAL_DTYPE": "dtype", "BASAL_LOCAL_API_KEY": "api_key",
                   "BASAL_LOCAL_GPU_MEMORY": "gpu_memory"}
        for var, key in env_map.items():
            if var in os.environ:
                values[key] = os.environ[var]
        values.update({k: v for k, v in overrides.items() if v is not None})
        settings = cls()
        engine_fields = {f.name for f in fields(EngineSettings)}
        for key, value in values.items():
            try:
                if key in engine_fields:
                    kind = type(getattr(settings.engine, key))
                    setattr(settings.engine, key, kind(value))
                elif key in {f.name for f in fields(cls)} and key not in ("engine", "aliases"):
                    current = getattr(settings, key)
                    if isinstance(current, bool):
                        value = value if isinstance(value, bool) else str(value).lower() in ("1", "true", "yes")
                    elif isinstance(current, int):
                        value = int(value)
                    elif isinstance(current, float):
                        value = float(value)
                    elif isinstance(current, list) and isinstance(value, str):
                        value = [value]
                    setattr(settings, key, value)
                else:
                    raise ValueError(f"{path}: unknown setting {key!r}")
            except (TypeError, ValueError) as exc:
                if str(exc).startswith(str(path)):
                    raise
                raise ValueError(f"{path}: setting {key!r} has an invalid value {value!r}") from None
        if isinstance(settings.models, str):
            settings.models = [settings.models]
        if not 0 < settings.port < 65536:
            raise ValueError(f"port {settings.port} is not a TCP port (use 1-65535)")
        settings.aliases = dict(aliases)
        return settings


def config_path() -> Path:
    """Where `config.toml` is read from when --config is not given."""
    return home_dirs()["config"] / "config.toml"

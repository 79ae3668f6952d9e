"""The daemon's settings, declared in basal_local/settings.py (kept importable here for older imports)."""

from __future__ import annotations

from ..paths import APP, home_dirs
from ..settings import EngineSettings, Settings, config_path

__all__ = ["APP", "EngineSettings", "Settings", "config_path", "home_dirs"]

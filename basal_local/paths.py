"""The user folders of basal-local (config, cache, logs, state), below every layer that needs them."""

from __future__ import annotations

import os
from pathlib import Path

import platformdirs

APP = "basal-local"


def process_alive(pid: int) -> bool:
    """Whether process `pid` runs on this machine (another user's counts): the owner of a state file, or of a
    file a process left half-written in these folders."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def home_dirs() -> dict[str, Path]:
    """Config, cache, logs, state and data (the Batch API's files) folders; BASAL_LOCAL_HOME moves everything."""
    home = os.environ.get("BASAL_LOCAL_HOME")
    if home:
        base = Path(home).expanduser()
        return {"config": base, "cache": base / "cache", "logs": base / "logs", "state": base / "state",
                "data": base / "data"}
    return {"config": Path(platformdirs.user_config_dir(APP)), "cache": Path(platformdirs.user_cache_dir(APP)),
            "logs": Path(platformdirs.user_log_dir(APP)), "state": Path(platformdirs.user_state_dir(APP)),
            "data": Path(platformdirs.user_data_dir(APP))}

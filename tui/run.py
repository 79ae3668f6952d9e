"""Entry points: `basal-local top` (attach to a daemon) and the dashboard half of `serve --tui`."""

from __future__ import annotations

import asyncio

from .app import DashboardApp
from .client import DaemonClient


def run_top(url: str, capture_print: bool = False, api_key: str | None = None) -> int:
    """Run the dashboard against the daemon at `url` until the user quits (q)."""
    client = DaemonClient(url, api_key=api_key)
    app = DashboardApp(client, capture_print=capture_print)
    try:
        app.run()
    finally:
        try:
            asyncio.run(client.aclose())
        except Exception:  # its connections belonged to the app's closed loop; nothing left to release
            pass
    return app.return_code or 0

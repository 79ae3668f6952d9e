"""Entry points: `basal-local top` (attach to a daemon) and the dashboard half of `serve --tui`."""

from __future__ import annotations

import asyncio
import signal
import threading

from .app import DashboardApp
from .client import DaemonClient


def stop_on_signals(app: DashboardApp) -> None:
    """SIGINT (kill -INT, Ctrl-C outside raw mode) and SIGTERM close the dashboard as `q` does."""
    if threading.current_thread() is not threading.main_thread():
        return

    def stop(signum, frame) -> None:
        try:
            asyncio.get_running_loop().call_soon_threadsafe(app.exit)
        except RuntimeError:  # the app's loop is not running yet, or any more
            raise KeyboardInterrupt from None

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, stop)


def run_top(url: str, capture_print: bool = False, api_key: str | None = None) -> int:
    """Run the dashboard against the daemon at `url` until the user quits (q)."""
    client = DaemonClient(url, api_key=api_key)
    app = DashboardApp(client, capture_print=capture_print)
    stop_on_signals(app)
    try:
        app.run()
    finally:
        try:
            asyncio.run(client.aclose())
        except Exception:  # its connections belonged to the app's closed loop; nothing left to release
            pass
    return app.return_code or 0

"""Entry points: `basal-local top` (attach to a daemon) and the dashboard half of `serve --tui`."""

from __future__ import annotations

import asyncio
import signal
import sys
import threading

from .app import DashboardApp
from .client import DaemonClient


def no_terminal(command: str = "serve --tui") -> str | None:
    """Why the dashboard cannot run here (stdin or stdout is not a terminal), in one sentence for `command`; None
    if it can."""
    instead = ("run `basal-local serve` without --tui (or `basal-local top` in a terminal)" if command != "top" else
               "run `basal-local top` in a terminal; `basal-local ps` and /api/stats show the same without one")
    for name, stream in (("standard input", sys.__stdin__), ("standard output", sys.__stdout__)):
        if stream is None or not stream.isatty():
            return f"the dashboard needs a terminal, and {name} is not one; {instead}"
    return None


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


def run_top(url: str, capture_print: bool = False, api_key: str | None = None, owns_daemon: bool = False) -> int:
    """Run the dashboard against the daemon at `url` until the user quits (q)."""
    reason = no_terminal("serve --tui" if owns_daemon else "top")
    if reason:  # Textual would write escape sequences into a file or a pipe
        print(f"basal-local: error: {reason}", file=sys.__stderr__ or sys.stderr)
        return 2
    client = DaemonClient(url, api_key=api_key)
    app = DashboardApp(client, capture_print=capture_print, owns_daemon=owns_daemon)
    stop_on_signals(app)
    try:
        app.run()
    finally:
        try:
            asyncio.run(client.aclose())
        except Exception:  # its connections belonged to the app's closed loop; nothing left to release
            pass
    return app.return_code or 0

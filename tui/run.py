"""Entry points: `basal-local top` (attach to a daemon) and the dashboard half of `serve --tui`."""

from __future__ import annotations

import asyncio
import sys

from .app import DashboardApp
from .client import DaemonClient


def no_terminal() -> str | None:
    """Why the dashboard cannot run here (stdin or stdout is not a terminal), in one sentence; None if it can."""
    for name, stream in (("standard input", sys.__stdin__), ("standard output", sys.__stdout__)):
        if stream is None or not stream.isatty():
            return (f"the dashboard needs a terminal, and {name} is not one; run `basal-local serve` without --tui "
                    f"(or `basal-local top` in a terminal)")
    return None


def run_top(url: str, capture_print: bool = False, owns_daemon: bool = False) -> int:
    """Run the dashboard against the daemon at `url` until the user quits (q)."""
    reason = no_terminal()
    if reason:  # Textual would write escape sequences into a file or a pipe
        print(f"basal-local: error: {reason}", file=sys.__stderr__ or sys.stderr)
        return 2
    client = DaemonClient(url)
    app = DashboardApp(client, capture_print=capture_print, owns_daemon=owns_daemon)
    try:
        app.run()
    finally:
        try:
            asyncio.run(client.aclose())
        except Exception:  # its connections belonged to the app's closed loop; nothing left to release
            pass
    return app.return_code or 0

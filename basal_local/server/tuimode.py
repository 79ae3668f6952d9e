"""`basal-local serve --tui`: the daemon in a background thread, the dashboard in front, one process.

The daemon keeps its own event loop and threads (uvicorn in a thread installs no signal handlers; inference
runs on the engine's lane threads), the dashboard attaches over HTTP exactly as `basal-local top` does.
Logging goes to the event bus (the log pane) and nothing is printed over the screen. `--demo-traffic`
(demotraffic.py) sends bursts about shared documents, long documents and large choices from a few threads.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import logging
import sys
import threading
import time
from pathlib import Path

from ..addresses import local_url
from .daemon import _Server, build, serve, shutdown, start_loading
from .demotraffic import demo_traffic
from .events import BusLogHandler
from .settings import Settings
from .state import AppState

log = logging.getLogger("basal_local.demo")


def _route_logging(state: AppState) -> None:
    """Every log record goes to the event bus (the log pane); none to the terminal the dashboard owns."""
    root = logging.getLogger()
    for handler in list(root.handlers):
        root.removeHandler(handler)
    root.addHandler(BusLogHandler(state, logging.INFO))
    root.setLevel(logging.WARNING)
    logging.getLogger("basal_local").setLevel(logging.INFO)
    logging.getLogger("httpx").setLevel(logging.WARNING)  # the dashboard's own requests
    for name in ("uvicorn", "uvicorn.error", "uvicorn.access"):
        logger = logging.getLogger(name)
        logger.handlers.clear()
        logger.propagate = True


def serve_with_options(settings: Settings, model_dirs: list[Path], banner: str, tui: bool, traffic: bool) -> int:
    """`serve --tui` and/or `--demo-traffic`; without --tui the daemon runs as usual with traffic beside it."""
    if tui:
        from basal_local.tui.run import no_terminal  # textual: heavy, imported only when the dashboard runs

        reason = no_terminal()
        if reason:  # before the daemon starts: a file or a pipe gets one sentence, no escape sequences
            print(f"basal-local: error: {reason}", file=sys.stderr)
            return 2
        return serve_with_dashboard(settings, model_dirs, traffic)

    stop = threading.Event()
    demo_traffic(local_url(settings.host, settings.port), stop, api_key=settings.api_key)
    try:
        return serve(settings, model_dirs, banner)
    finally:
        stop.set()


class _LogStream(io.TextIOBase):
    """stdout/stderr while the dashboard owns the terminal: each line becomes a log record (the log pane)."""

    def write(self, text: str) -> int:
        for line in text.splitlines():
            if line.strip():
                log.info("%s", line)
        return len(text)


def serve_with_dashboard(settings: Settings, model_dirs: list[Path], traffic: bool = False) -> int:
    try:
        with contextlib.redirect_stdout(_LogStream()), contextlib.redirect_stderr(_LogStream()):
            code = _serve_with_dashboard(settings, model_dirs, traffic)
    except OSError as exc:
        print(f"basal-local: error: {exc}", file=sys.stderr)
        return 1
    print("basal-local: stopped", flush=True)
    return code


def _serve_with_dashboard(settings: Settings, model_dirs: list[Path], traffic: bool) -> int:
    from basal_local.tui.run import run_top  # textual: heavy, imported only when the dashboard runs

    # the same guarded app, limits and server options as `serve`; the log goes to the dashboard's log pane
    state, config = build(settings, model_dirs, quiet=True)
    _route_logging(state)
    start_loading(state, settings, model_dirs)
    server = _Server(config, state)
    failed: list[BaseException] = []

    def run_server() -> None:
        try:
            asyncio.run(server.serve())  # not the main thread: uvicorn installs no signal handlers
        except BaseException as exc:  # e.g. the port is taken; reported after the dashboard closes
            failed.append(exc)

    thread = threading.Thread(target=run_server, name="basal-local-daemon", daemon=True)
    thread.start()
    deadline = time.time() + 10
    while not server.started and thread.is_alive() and time.time() < deadline:
        time.sleep(0.02)
    if server.started:
        _route_logging(state)  # again: litestar set up its own root handler at startup (it would print)
    else:
        raise OSError(f"the daemon could not listen on {settings.host}:{settings.port} (is the port taken?)")
    stop = threading.Event()
    url = local_url(settings.host, settings.port)
    if traffic:
        demo_traffic(url, stop, api_key=settings.api_key)
    try:
        code = run_top(url, capture_print=True, api_key=settings.api_key, owns_daemon=True)
    finally:
        # the terminal is back; say why it waits (the drain) instead of leaving it blank
        print("basal-local: stopping the daemon...", file=sys.__stdout__, flush=True)
        stop.set()
        server.should_exit = True
        thread.join(timeout=10)
        shutdown(state)
    print("basal-local: stopped", flush=True)
    return code

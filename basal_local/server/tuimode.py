"""`basal-local serve --tui`: the daemon in a background thread, the dashboard in front, one process.

The daemon keeps its own event loop and threads (uvicorn in a thread installs no signal handlers; inference
runs on the engine's lane threads), the dashboard attaches over HTTP exactly as `basal-local top` does.
Logging goes to the event bus (the log pane) and nothing is printed over the screen. `--demo-traffic` sends
the bundled sample requests in a loop from a few client threads.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import logging
import random
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

from .app import AppState
from .daemon import _Server, build, shutdown, start_loading
from .events import BusLogHandler
from .settings import Settings

log = logging.getLogger("basal_local.demo")
DEMO_AGENT = "demo-traffic"


def demo_traffic(url: str, stop: threading.Event, clients: int = 3, pause_s: float = 0.3,
                 api_key: str | None = None) -> list[threading.Thread]:
    """Threads that post the sample requests (whole, then question by question) until `stop` is set."""
    from ..bench import sample_requests

    samples = sample_requests()
    auth = {"authorization": f"Bearer {api_key}"} if api_key else {}

    def post(body: dict) -> None:
        req = urllib.request.Request(f"{url}/v1/systemone", json.dumps(body).encode(), method="POST",
                                     headers={"content-type": "application/json", "user-agent": DEMO_AGENT, **auth})
        try:
            with urllib.request.urlopen(req, timeout=60) as resp:
                resp.read()
        except urllib.error.HTTPError as err:
            err.read()

    def client(n: int) -> None:
        rng = random.Random(n)
        model = ""
        while not stop.is_set():
            try:
                if not model:
                    health = urllib.request.Request(f"{url}/health", headers=auth)
                    with urllib.request.urlopen(health, timeout=5) as resp:
                        model = json.load(resp)["default_model"]
                item = rng.choice(samples)
                questions = item["questions"]
                if rng.random() < 0.5:  # one question at a time, like many small clients
                    qid = rng.choice(list(questions))
                    questions = {qid: questions[qid]}
                post({"model": model, "state": item["state"], "questions": questions})
            except (OSError, ValueError, KeyError):
                stop.wait(1.0)  # loading, or the daemon went away
                continue
            stop.wait(rng.uniform(0, 2 * pause_s))

    threads = [threading.Thread(target=client, args=(n,), name=f"demo-traffic-{n}", daemon=True)
               for n in range(clients)]
    for thread in threads:
        thread.start()
    return threads


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


def local_url(host: str, port: int) -> str:
    """Where a client on this machine reaches a daemon bound to host:port."""
    if host in ("0.0.0.0", "", "::"):
        host = "127.0.0.1"
    elif ":" in host:
        host = f"[{host}]"
    return f"http://{host}:{port}"


def serve_with_options(settings: Settings, model_dirs: list[Path], banner: str, tui: bool, traffic: bool) -> int:
    """`serve --tui` and/or `--demo-traffic`; without --tui the daemon runs as usual with traffic beside it."""
    if tui:
        return serve_with_dashboard(settings, model_dirs, traffic)
    from .daemon import serve

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
    from basal_local.tui.run import run_top

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
        code = run_top(url, capture_print=True, api_key=settings.api_key)
    finally:
        stop.set()
        server.should_exit = True
        thread.join(timeout=10)
        shutdown(state)
    print("basal-local: stopped", flush=True)
    return code

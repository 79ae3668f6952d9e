"""How worker processes start, and how the helper that starts them ends.

CUDA cannot be forked once initialised, so never a plain fork. On Linux a forkserver: one clean process imports
torch and the worker's modules once (it never touches a device) and every worker is a fork of it, instead of
`spawn`'s fresh interpreter per worker, each importing torch again (7-9 s of CPU apiece on a small machine; with
8 GPUs, 8 imports at once). Elsewhere `spawn`.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import sys
import time
from multiprocessing.context import BaseContext

PRELOAD = ["basal_local.replicas.shield", "torch", "numpy", "basal_local.replicas.worker"]  # shield first


def start_context() -> BaseContext:
    if sys.platform.startswith("linux"):
        context = multiprocessing.get_context("forkserver")
        context.set_forkserver_preload(PRELOAD)
        _ensure_forkserver()
        return context
    return multiprocessing.get_context("spawn")


def _ensure_forkserver() -> None:
    """Start the forkserver (if none runs) with SIGINT blocked, as CPython starts its resource tracker: a Ctrl-C
    to the process group in the new interpreter's first ~50 ms, before `shield` runs, stays pending instead of
    killing it with a traceback; `shield` then ignores SIGINT (which drops the pending one) and unblocks it. The
    mask is per thread and inherited through fork and exec, so this works from any thread (signal.signal would
    need the main one). The resource tracker starts first: its own start unblocks SIGINT whatever the mask was."""
    from multiprocessing import forkserver, resource_tracker

    resource_tracker.ensure_running()
    old = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        forkserver.ensure_running()
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


def _forkservers() -> list[int]:
    """Pids of this process's children that are multiprocessing forkservers and still run (Linux /proc)."""
    me, out = os.getpid(), []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", encoding="utf-8") as fh:
                fields = fh.read().rsplit(")", 1)[1].split()
            if fields[0] == "Z" or int(fields[1]) != me:
                continue
            with open(f"/proc/{entry}/cmdline", "rb") as fh:
                if b"multiprocessing.forkserver" in fh.read():
                    out.append(int(entry))
        except (OSError, IndexError, ValueError):
            continue
    return out


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", encoding="utf-8") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def end_forkserver(grace_s: float = 5.0) -> None:
    """End the forkserver once every worker has stopped. It ends by itself when this process exits, but on a
    loaded machine it outlived the daemon by more than 30 s in tests, and with it the resource tracker (whose last
    pipe it holds). SIGTERM, then SIGKILL after `grace_s`. It is not reaped here: multiprocessing reaps it and
    starts a new one when workers start again (tests). A no-op where none runs."""
    if not sys.platform.startswith("linux"):
        return
    for pid in _forkservers():
        try:
            os.kill(pid, signal.SIGTERM)
            deadline = time.monotonic() + grace_s
            while _running(pid):
                if time.monotonic() > deadline:
                    os.kill(pid, signal.SIGKILL)
                    break
                time.sleep(0.02)
        except OSError:  # already gone
            pass

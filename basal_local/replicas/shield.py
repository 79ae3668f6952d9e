"""Imported first by the worker forkserver (`start.PRELOAD`): it ignores SIGINT from its first line.

Ctrl-C in a terminal goes to the whole process group, the forkserver included. multiprocessing shields the
forkserver from it only after the preload, and the preload imports torch (seconds): a Ctrl-C then killed it with a
traceback, and the daemon saw its workers fail ("loading failed: unexpected EOF") instead of stopping them itself.
The daemon starts the forkserver with SIGINT blocked (`start._ensure_forkserver`), which covers the interpreter's
start before this line; here it is ignored (a pending one is dropped) and unblocked.
The workers ignore SIGINT as well (`worker.py`): the daemon drains and then tells them to stop.
"""

from __future__ import annotations

import signal
import sys

# only in the forkserver (started as `python -c "from multiprocessing.forkserver import main; main(...)"`), never
# in a process that imports this module by accident
if sys.argv[:1] == ["-c"] and "multiprocessing.forkserver" in sys.modules:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})

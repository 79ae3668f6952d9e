"""The daemon's output on a full disk (or a closed terminal): it keeps serving and says so once.

Standard output, standard error and the log file are where a daemon's lines go; any of them may sit on a disk that
fills up (ENOSPC), a terminal that went away (EIO) or a reader that left (EPIPE). Unguarded, a `print` there
raised out of start-up ("internal error: OSError") and every log record that could not be written printed a
"--- Logging error ---" traceback. `guard_output` makes both safe: `sys.stdout` writes straight to its file
descriptor and swallows the error, each log handler drops the record it cannot write; either way one warning
(through the handlers that still work) names what cannot be written, and the next write is tried again, so the
output comes back when the disk has room.
"""

from __future__ import annotations

import io
import logging
import os
import sys
import threading
from typing import Any

log = logging.getLogger("basal_local.daemon")
_GUARDED = "_basal_output_guarded"


class TolerantStdout:
    """Text written straight to a file descriptor, unbuffered; a failed write is dropped (one warning)."""

    errors = "replace"
    closed = False

    def __init__(self, stream: Any, name: str = "standard output") -> None:
        self.wrapped = stream
        self.fd = stream.fileno()
        self.label = name
        self.encoding = getattr(stream, "encoding", None) or "utf-8"
        self.failed = False
        self._lock = threading.Lock()

    def writable(self) -> bool:
        return True

    def fileno(self) -> int:
        return self.fd

    def isatty(self) -> bool:
        try:
            return os.isatty(self.fd)
        except OSError:
            return False

    def write(self, text: str) -> int:
        data = text.encode(self.encoding, "replace")
        with self._lock:
            try:
                view = memoryview(data)
                while view:
                    view = view[os.write(self.fd, view):]
                self.failed = False
            except OSError as exc:
                if not self.failed:
                    self.failed = True
                    log.warning("%s cannot be written (%s); the daemon keeps serving and drops what it cannot "
                                "write there", self.label, exc.strerror or exc)
        return len(text)

    def flush(self) -> None:  # nothing is buffered
        pass


def _guard_handler(handler: logging.Handler) -> None:
    if getattr(handler, _GUARDED, False) or not isinstance(handler, logging.StreamHandler):
        return
    original = handler.handleError
    where = getattr(handler, "baseFilename", None) or getattr(getattr(handler, "stream", None), "name", "a stream")
    state = {"failed": False}

    def handle_error(record: logging.LogRecord) -> None:
        exc = sys.exc_info()[1]
        if not isinstance(exc, OSError):
            original(record)
            return
        if state["failed"]:  # (what did not reach the file stays in its small buffer, written once there is room)
            return
        state["failed"] = True  # first: the warning below reaches this handler too, and fails there silently
        log.warning("the log output %s cannot be written (%s); the daemon keeps serving and drops the records it "
                    "cannot write there", where, exc.strerror or exc)

    handler.handleError = handle_error  # type: ignore[method-assign]
    setattr(handler, _GUARDED, True)


def guard_output() -> None:
    """Guard `sys.stdout` and every log handler present now (call again after adding one); idempotent."""
    if not isinstance(sys.stdout, TolerantStdout):
        try:
            sys.stdout.flush()
        except (OSError, ValueError):
            pass
        try:
            sys.stdout = TolerantStdout(sys.stdout)
        except (OSError, ValueError, AttributeError, io.UnsupportedOperation):  # no file descriptor (captured)
            pass
    loggers = [logging.getLogger()] + [obj for obj in logging.Logger.manager.loggerDict.values()
                                       if isinstance(obj, logging.Logger)]
    for logger in loggers:
        for handler in list(logger.handlers):
            _guard_handler(handler)

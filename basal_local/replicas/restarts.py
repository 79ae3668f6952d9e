"""When a replica's dead worker process starts again: the back-off per slot, its timers, the Retry-After meanwhile.

The first restart of a slot waits `RESTART_FIRST_S`; each further death within `STABLE_S` of the worker's load
doubles the wait, up to `RESTART_MAX_S` (a worker that crashes at once, on a device that is gone, is tried about
once a minute, not in a loop). A worker that served for `STABLE_S` and then died starts the back-off over.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable

log = logging.getLogger("basal_local.replicas.front")

RESTART_FIRST_S = 1.0  # a dead worker's first restart waits this long
RESTART_MAX_S = 60.0  # the back-off doubles per quick death up to this
STABLE_S = 60.0  # a worker that served this long after loading died on its own: its back-off starts over


class Restarts:
    """The restart timers of one replica set; `spawn(slot)` starts that slot's worker again (on a timer thread)."""

    def __init__(self, slots: list[int], spawn: Callable[[int], None], name: str) -> None:
        self.spawn = spawn
        self.name = name
        self.count = {slot: 0 for slot in slots}  # restarts started, per slot
        self.at: dict[int, float] = {}  # slot -> monotonic time of its next start
        self.exit_codes: dict[int, int | None] = {}  # slot -> the last dead process's exit code
        self.load_s = 0.0  # the longest first load: the Retry-After while a restarted worker loads
        self.serving = False  # every worker loaded once: from now on a dead one is restarted
        self._quick = {slot: 0 for slot in slots}
        self._halt = threading.Event()
        self._lock = threading.Lock()  # a spawn vs stop
        self._stopped = False

    def stop(self) -> None:
        """No restart spawns a worker after this returns."""
        with self._lock:
            self._stopped = True
        self._halt.set()

    def schedule(self, slot: int, ready_at: float | None) -> float | None:
        """Start the slot's worker again after its back-off; the delay, or None (stopping, not serving yet)."""
        if self._stopped or not self.serving:
            return None
        if ready_at is not None and time.monotonic() - ready_at >= STABLE_S:
            self._quick[slot] = 0
        delay = min(RESTART_MAX_S, RESTART_FIRST_S * 2 ** self._quick[slot])
        self._quick[slot] += 1
        self.at[slot] = time.monotonic() + delay
        threading.Thread(target=self._run, args=(slot, delay), name=f"basal-replica-{slot}-restart",
                         daemon=True).start()
        return delay

    def _run(self, slot: int, delay: float) -> None:
        if self._halt.wait(delay):
            return
        with self._lock:
            if self._stopped:
                return
            self.count[slot] += 1
            try:
                self.spawn(slot)
            except Exception as exc:  # no process (out of memory, the forkserver gone): try again later
                self.at.pop(slot, None)
                again = self.schedule(slot, None)
                log.error("replica %d of %s: its worker process did not start (%s: %s); next try in %.0f s", slot,
                          self.name, type(exc).__name__, exc, again or 0.0)
                return
            self.at.pop(slot, None)

    def retry_after_s(self, loading_since: list[float]) -> int:
        """Seconds until a dead worker should serve again: a waiting restart's rest plus a load, or what is left
        of a load under way (`loading_since`: the start times of the workers loading now)."""
        clock = time.monotonic()
        waits = [max(0.0, at - clock) + self.load_s for at in list(self.at.values())]
        waits += [max(0.0, self.load_s - (clock - started)) for started in loading_since]
        return min(120, max(1, math.ceil(min(waits, default=5.0))))

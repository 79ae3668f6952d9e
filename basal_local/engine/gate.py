"""One gate per device: main lanes (urgent) go before long lanes (preemptible), ENGINE.md §3.

A long lane calls `checkpoint()` between layers; once it has held the device for `slice_s` and an urgent
caller waits, it parks, exactly one urgent batch runs, and the device is handed straight back.
"""

from __future__ import annotations

import threading
import time


class DeviceGate:
    def __init__(self, slice_s: float = 0.1) -> None:
        self.slice_s = slice_s
        self._cond = threading.Condition()
        self._busy = False
        self._holder_urgent = False
        self._urgent_waiting = 0
        self._parked = 0
        self._handback = False
        self._held_since = 0.0
        self.handoffs = 0

    def acquire(self, urgent: bool) -> None:
        with self._cond:
            if urgent:
                self._urgent_waiting += 1
                while self._busy or self._handback:
                    self._cond.wait()
                self._urgent_waiting -= 1
            else:
                while self._busy or self._urgent_waiting or self._parked or self._handback:
                    self._cond.wait()
            self._busy = True
            self._holder_urgent = urgent
            self._held_since = time.perf_counter()

    def release(self) -> None:
        with self._cond:
            self._busy = False
            if self._parked and self._holder_urgent:
                self._handback = True
            self._cond.notify_all()

    def checkpoint(self) -> None:
        """Called by a preemptible holder between layers: park for one urgent turn if one is due."""
        with self._cond:
            if not self._urgent_waiting or time.perf_counter() - self._held_since < self.slice_s:
                return
            self.handoffs += 1
            self._parked += 1
            self._busy = False
            self._cond.notify_all()
            while not self._handback:
                self._cond.wait()
            self._handback = False
            self._parked -= 1
            self._busy = True
            self._holder_urgent = False
            self._held_since = time.perf_counter()
            self._cond.notify_all()

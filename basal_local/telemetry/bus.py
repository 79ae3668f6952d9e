"""The event bus: producers never wait, each subscriber reads through its own bounded queue.

`emit` runs on engine threads and on the server's event loop. It appends to a bounded history and to every
subscriber's queue under one short lock, and wakes a waiting subscriber at most once per drain. A subscriber
that falls behind loses its oldest events (counted in `dropped`); it never slows the producer down.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

Event = dict[str, Any]


class Subscription:
    """One reader's bounded queue. `drain()` takes everything queued; `waker` is called when events arrive."""

    def __init__(self, bus: EventBus, max_queued: int) -> None:
        self._bus = bus
        self._items: deque[Event] = deque()
        self._max = max_queued
        self._lock = threading.Lock()
        self._armed = True  # wake the reader on the next event
        self.dropped = 0
        self.waker: Callable[[], None] | None = None

    def put(self, event: Event) -> None:
        with self._lock:
            if len(self._items) >= self._max:
                self._items.popleft()
                self.dropped += 1
            self._items.append(event)
            wake = self.waker if self._armed else None
            self._armed = False
        if wake is not None:
            try:
                wake()
            except RuntimeError:  # the reader's event loop is gone; it will be unsubscribed
                pass

    def drain(self) -> tuple[list[Event], int]:
        """(queued events, events lost since the last drain)."""
        with self._lock:
            items = list(self._items)
            self._items.clear()
            dropped, self.dropped = self.dropped, 0
            self._armed = True
        return items, dropped

    def close(self) -> None:
        self._bus.unsubscribe(self)


class EventBus:
    """Bounded history of events plus live subscribers. Events are dicts with `seq`, `ts` and `kind`."""

    def __init__(self, history: int = 2048) -> None:
        self._lock = threading.Lock()
        self._seq = itertools.count(1)
        self.history: deque[Event] = deque(maxlen=history)
        self._subscribers: list[Subscription] = []

    def emit(self, kind: str, **fields: Any) -> Event:
        event = {"seq": 0, "ts": round(time.time(), 6), "kind": kind, **fields}
        with self._lock:  # numbered and queued under one lock: every subscriber gets the events in `seq` order
            event["seq"] = next(self._seq)
            self.history.append(event)
            for sub in self._subscribers:
                sub.put(event)
        return event

    def subscribe(self, max_queued: int = 4096, since: int | None = None) -> Subscription:
        """A new reader; with `since`, the events of the history after that sequence number come first."""
        sub = Subscription(self, max_queued)
        with self._lock:
            if since is not None:
                for event in self.history:
                    if event["seq"] > since:
                        sub.put(event)
            self._subscribers.append(sub)
        return sub

    def unsubscribe(self, sub: Subscription) -> None:
        with self._lock:
            if sub in self._subscribers:
                self._subscribers.remove(sub)

    @property
    def subscribers(self) -> int:
        with self._lock:
            return len(self._subscribers)

"""Gates: one per device (main lanes before long ones, docs/ARCHITECTURE.md), and the daemon's admission (`Admission`).

A long lane calls `checkpoint()` between layers; once it has held the device for `slice_s` and an urgent
caller waits, it parks, exactly one urgent batch runs, and the device is handed straight back.
"""

from __future__ import annotations

import bisect
import math
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass, field


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


# --- admission of decision requests (docs/PROTOCOL.md §1.2, docs/ARCHITECTURE.md "Scheduling") --------------------------------

MAX_DELAY_S = 30.0  # the longest hint: clients cap Retry-After at 30 s (docs/WIRE.md)
MAX_RESERVATIONS = 256  # slots kept at once: what a burst needs, and a bound on the work of each 529
CLAIM_WAIT_S = 1.0  # the longest wait of a retry that came in its slot...
CLAIM_WAIT_MIN_S = 0.25  # ...and at least this, to ride out one slow request
SPACING_MARGIN = 1.25  # slots a little wider than the mean service time: a slow request does not push all later
SHARE_ALPHA = 0.1  # how fast the shares of clients that honour each header follow what they do


@dataclass
class Reservation:
    """The retry slot one 529 handed out: `ms_at` for clients that honour `retry-after-ms`, `int_at` for those
    that read only the whole-second `Retry-After` (clock times; the first arrival in either window claims it)."""

    ms_at: float
    int_at: float
    ms_counted: bool = False
    int_counted: bool = False


@dataclass
class Entry:
    """What `Admission.enter` decided: admitted, waiting (for `wait_s`, on `future`) or rejected (`headers`)."""

    state: str
    since: float = 0.0
    wait_s: float = 0.0
    future: Future | None = None
    claimed: bool = False
    headers: dict[str, str] = field(default_factory=dict)
    granted: bool = False

    @property
    def admitted(self) -> bool:
        return self.state == "admitted"


class Admission:
    """At most `limit` decision requests in flight; a request beyond waits a bounded moment, then gets a 529 whose
    retry slot is kept for it.

    Slots are spaced by the measured service time (an EMA of how long admitted requests hold their place) over the
    limit, so each is when a place is expected to be free. A request arriving in an unclaimed slot's window claims
    it: it takes a free place that new arrivals may not (they leave places to open windows), or waits ahead of
    them. `Retry-After` gets its own whole-second schedule, at most `per_second` arrivals near each second, so
    clients that read only the integer do not all come back at once. Slots count at the share of clients that
    claimed theirs: after a storm of clients that ignore the hints, the slots come back to the real load.
    """

    def __init__(self, wait_s: float = 0.1, service_s: float = 0.05, clock: Callable[[], float] = time.monotonic):
        self.wait_cap_s = wait_s
        self.service_s = service_s
        self.service_var = 0.0
        self.clock = clock
        self.inflight = 0
        self.waiters: list[Entry] = []  # claimed retries first, then in arrival order
        self.reservations: list[Reservation] = []
        self.ms_share = 1.0  # of reserved slots, the share claimed at the retry-after-ms slot
        self.int_share = 1.0  # ... and at the whole-second Retry-After
        self.claims = self.rejections = 0
        self._lock = threading.Lock()

    # the clock-derived sizes
    def spacing(self, limit: int) -> float:
        """How often a place is expected free: the service time (plus one deviation: on a busy machine a few
        requests take many times the mean) over the places, with a margin."""
        return max(SPACING_MARGIN * (self.service_s + math.sqrt(self.service_var)) / max(limit, 1), 1e-4)

    def wait_s(self, limit: int) -> float:
        """The bounded wait before a 529: a couple of places' turnover, never more than the cap."""
        return min(self.wait_cap_s, 2.0 * self.spacing(limit))

    def windows(self, limit: int) -> tuple[float, float]:
        """(early, late): how far before and after its slot a retry still claims it."""
        spacing = self.spacing(limit)
        return min(spacing, 0.25), max(2.0 * spacing, 0.15)

    def enter(self, limit: int, retry: bool = False) -> Entry:
        now = self.clock()
        with self._lock:
            self._expire(now, limit)
            slot = self._open_slot(now, limit, retry)
            claimed = slot is not None
            held = 0 if claimed else self._held(now, limit)
            queue_ahead = any(w.claimed for w in self.waiters) if claimed else bool(self.waiters)
            if self.inflight + held < limit and not queue_ahead:
                self.inflight += 1
                self._claim(slot, now, limit)
                return Entry("admitted", since=now, claimed=claimed)
            wait = self.wait_s(limit)
            # a marked retry that came when told to may wait out the service time's variance; an unmarked arrival
            # in a whole-second slot (it may be a new request) keeps the short wait, so new requests wait no longer
            if claimed and retry and wait > 0:
                wait = min(CLAIM_WAIT_S, max(wait, 4.0 * self.spacing(limit), CLAIM_WAIT_MIN_S))
            # wait only where a place can come within the wait (a longer queue would only time out)
            room = math.floor(wait / self.spacing(limit))
            if wait > 0 and limit > 0 and sum(1 for w in self.waiters if w.claimed or not claimed) < room:
                entry = Entry("waiting", since=now, wait_s=wait, future=Future(), claimed=claimed)
                at = sum(1 for w in self.waiters if w.claimed) if claimed else len(self.waiters)
                self.waiters.insert(at, entry)
                self._claim(slot, now, limit)
                return entry
            # a claimant that cannot get in leaves the slot open (it did not get its turn: no evidence either way)
            return self._reject(now, limit)

    def give_up(self, entry: Entry, limit: int) -> Entry:
        """A waiter's time ran out: admitted if a place was handed to it meanwhile, else a 529 with its slot."""
        now = self.clock()
        with self._lock:
            if entry.granted:
                return Entry("admitted", since=entry.since, claimed=entry.claimed)
            if entry in self.waiters:
                self.waiters.remove(entry)
            self._expire(now, limit)
            if self.inflight + (0 if entry.claimed else self._held(now, limit)) < limit:  # a kept window lapsed
                self.inflight += 1
                return Entry("admitted", since=now, claimed=entry.claimed)
            return self._reject(now, limit)

    def leave(self, entry: Entry) -> None:
        """An admitted request is done: its place goes to the first waiter, else back to the pool."""
        now = self.clock()
        with self._lock:
            held = min(now - entry.since, MAX_DELAY_S)
            self.service_var = 0.8 * self.service_var + 0.2 * (held - self.service_s) ** 2
            self.service_s = 0.8 * self.service_s + 0.2 * held
            while self.waiters:
                waiter = self.waiters.pop(0)
                waiter.granted, waiter.since = True, now
                try:
                    waiter.future.set_result(True)  # type: ignore[union-attr]
                except InvalidStateError:  # its wait was cancelled: `give_up` sees `granted` and takes the place
                    pass
                return
            self.inflight -= 1

    def _reject(self, now: float, limit: int) -> Entry:
        self.rejections += 1
        ms_delay = min(self._first_free(now, limit) - now, MAX_DELAY_S)
        seconds = self._whole_second(now, limit, max(1, math.ceil(ms_delay - 1e-9)))
        # a hint at the cap is no slot, and past MAX_RESERVATIONS slots (a storm) nothing more is kept
        if len(self.reservations) < MAX_RESERVATIONS and (ms_delay < MAX_DELAY_S or seconds <= MAX_DELAY_S):
            self.reservations.append(Reservation(now + ms_delay, now + seconds, ms_counted=ms_delay >= MAX_DELAY_S,
                                                 int_counted=seconds > MAX_DELAY_S))
        seconds = min(seconds, int(MAX_DELAY_S))
        ms = int(ms_delay * 1000.0) + 1
        return Entry("rejected", since=now, headers={"retry-after": str(seconds), "retry-after-ms": str(ms)})

    def _first_free(self, now: float, limit: int) -> float:
        """When a place is expected free for one more request: one place turns over per `spacing`; the waiters
        and the slots handed out before that time (at the share of clients that come in them) go first."""
        spacing = self.spacing(limit)
        due = sorted([(r.ms_at, self.ms_share) for r in self.reservations if not r.ms_counted and r.ms_at >= now]
                     + [(r.int_at, self.int_share) for r in self.reservations
                        if not r.int_counted and r.int_at >= now])
        demand = float(len(self.waiters))
        free = now + spacing * (1.0 + demand)
        for at, share in due:
            if at >= free + spacing:  # a slot holds its place for one turnover: a later one is no obstacle
                break
            demand += share
            free = now + spacing * (1.0 + demand)
        return free

    def _whole_second(self, now: float, limit: int, first: int) -> int:
        """The first whole second from `first` on with room: within a turnover of that instant, at most as many
        integer-only retries as the bounded wait lets in one after another (weighted by the share that come)."""
        spacing = self.spacing(limit)
        room = 1.0 + math.floor(self.wait_s(limit) / spacing)
        taken = sorted(r.int_at for r in self.reservations if not r.int_counted)
        for seconds in range(first, int(MAX_DELAY_S) + 1):
            at = now + seconds  # integer-only clients rejected together all come back at this instant
            near = bisect.bisect_left(taken, at + spacing) - bisect.bisect_right(taken, at - spacing)
            if near * self.int_share < room:
                return seconds
        return int(MAX_DELAY_S) + 1  # no room: the cap, with no whole-second slot kept

    def _open_slot(self, now: float, limit: int, retry: bool) -> tuple[Reservation, bool] | None:
        """The first unclaimed window open now, for this request: retry-after-ms slots to marked retries
        (typesafe-sdk marks them), whole-second slots to anyone (integer-only clients may not mark theirs)."""
        early, late = self.windows(limit)
        for r in self.reservations:
            on_ms = retry and not r.ms_counted and r.ms_at - early <= now <= r.ms_at + late
            if on_ms or (not r.int_counted and r.int_at - early <= now <= r.int_at + late):
                return r, on_ms
        return None

    def _claim(self, slot: tuple[Reservation, bool] | None, now: float, limit: int) -> None:
        """The slot is taken: dropped, and its headers' shares told which one the client honoured."""
        if slot is None:
            return
        r, on_ms = slot
        self.reservations.remove(r)
        self.claims += 1
        if not r.ms_counted:
            self.ms_share += SHARE_ALPHA * (float(on_ms) - self.ms_share)
        if not r.int_counted:
            self.int_share += SHARE_ALPHA * (float(not on_ms) - self.int_share)

    def _held(self, now: float, limit: int) -> int:
        """Places kept for open windows of clients that mostly honour that header."""
        early, late = self.windows(limit)
        held = 0
        for r in self.reservations:
            if (self.ms_share >= 0.5 and not r.ms_counted and r.ms_at - early <= now <= r.ms_at + late) or \
                    (self.int_share >= 0.5 and not r.int_counted and r.int_at - early <= now <= r.int_at + late):
                held += 1
        return min(held, limit)

    def _expire(self, now: float, limit: int) -> None:
        """Windows that passed unclaimed count against their header's share; a slot past both is dropped."""
        _, late = self.windows(limit)
        kept = []
        for r in self.reservations:
            if not r.ms_counted and now > r.ms_at + late:
                r.ms_counted = True
                self.ms_share -= SHARE_ALPHA * self.ms_share
            if not r.int_counted and now > r.int_at + late:
                r.int_counted = True
                self.int_share -= SHARE_ALPHA * self.int_share
            if not (r.ms_counted and r.int_counted):
                kept.append(r)
        self.reservations = kept

    def snapshot(self) -> dict[str, float | int]:
        with self._lock:
            return {"inflight": self.inflight, "waiting": len(self.waiters), "reserved": len(self.reservations),
                    "service_ms": round(self.service_s * 1000.0, 3), "ms_share": round(self.ms_share, 3),
                    "int_share": round(self.int_share, 3), "claims": self.claims, "rejections": self.rejections}

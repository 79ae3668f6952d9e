"""Admission and its retry slots (engine/gate.py `Admission`) on a fake clock: slots spaced by the service time, a
retry in its slot served ahead of new arrivals, integer `Retry-After` spread, hints that follow the real load."""

from collections import Counter

from basal_local.engine.gate import MAX_DELAY_S, Admission


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def make(wait_s=0.0, service_s=0.1):
    clock = Clock()
    return Admission(wait_s=wait_s, service_s=service_s, clock=clock), clock


def slot(entry, clock):
    return clock.t + int(entry.headers["retry-after-ms"]) / 1000.0


def test_rejected_requests_get_distinct_slots_one_place_apart():
    adm, clock = make()
    assert adm.enter(1).admitted
    rejected = [adm.enter(1) for _ in range(19)]
    assert all(e.state == "rejected" for e in rejected)
    slots = [slot(e, clock) for e in rejected]
    gaps = [b - a for a, b in zip(slots, slots[1:])]
    assert min(gaps) >= 0.1 - 0.002  # a place turns over once per service time (0.1 s, one place), or later
    assert slots[0] - clock.t >= 0.1 and slots[-1] - clock.t < MAX_DELAY_S
    for e in rejected:  # the integer is never earlier than the millisecond slot
        assert int(e.headers["retry-after"]) >= int(e.headers["retry-after-ms"]) / 1000.0


def test_a_retry_in_its_slot_gets_the_place_ahead_of_a_new_arrival():
    adm, clock = make()
    first = adm.enter(1)
    retry_slot = slot(adm.enter(1), clock)
    clock.t = retry_slot - 0.01
    adm.leave(first)  # the place is free just before the slot...
    late_first_attempt = adm.enter(1)
    assert late_first_attempt.state == "rejected"  # ...and kept for the retry, not taken by a new arrival
    clock.t = retry_slot + 0.01
    retry = adm.enter(1, retry=True)
    assert retry.admitted and retry.claimed
    assert adm.inflight == 1


def test_an_unmarked_request_does_not_take_a_millisecond_slot():
    adm, clock = make()
    first = adm.enter(1)
    retry_slot = slot(adm.enter(1), clock)
    adm.leave(first)
    clock.t = retry_slot
    entry = adm.enter(1)  # not marked: a new arrival in someone's slot waits its turn
    assert entry.state == "rejected" and not entry.claimed


def test_a_retry_waits_briefly_ahead_of_new_arrivals_and_gets_the_next_place():
    adm, clock = make(wait_s=0.5)
    first = adm.enter(1)
    retry_slot = slot(adm.give_up(adm.enter(1), 1), clock)  # its wait ran out: a 529 with a slot
    clock.t = retry_slot
    newcomer = adm.enter(1)
    retry = adm.enter(1, retry=True)
    assert newcomer.state == retry.state == "waiting" and adm.waiters == [retry, newcomer]
    adm.leave(first)
    assert retry.future.done() and retry.granted and not newcomer.granted
    assert adm.give_up(retry, 1).admitted  # even if its wait had been cancelled just then
    assert adm.give_up(newcomer, 1).state == "rejected"


def test_the_wait_is_bounded_by_the_turnover_of_places():
    adm, _ = make(wait_s=5.0, service_s=0.1)
    adm.enter(4)
    assert adm.spacing(4) == 1.25 * 0.1 / 4  # a place turns over every service time / places, with a margin
    assert adm.wait_s(4) == 2 * adm.spacing(4)  # two places' turnover, not the 5 s cap
    adm, _ = make(wait_s=0.0)
    adm.enter(1)
    assert adm.enter(1).state == "rejected"  # no wait at all when it is off


def test_whole_second_retry_after_is_spread():
    adm, clock = make(wait_s=0.25, service_s=0.1)  # a burst of 20 at once: 1 admitted, 2 wait, 17 rejected
    adm.enter(1)
    waiting = [adm.enter(1) for _ in range(2)]
    assert [e.state for e in waiting] == ["waiting", "waiting"]
    seconds = Counter(int(adm.enter(1).headers["retry-after"]) for _ in range(17))
    room = 1 + int(0.25 // adm.spacing(1))  # integer-only retries one bounded wait lets in after one another
    assert max(seconds.values()) <= room and len(seconds) >= 17 // room


def test_hints_come_back_down_after_a_storm_of_clients_that_ignore_them():
    """30.2: a 20 s storm by clients that retry at once, unmarked, never in their slots; one place, 50 ms each."""
    adm, clock = make(service_s=0.05)
    running, hints = None, []

    def step():
        nonlocal running
        clock.t += 0.001
        if running is not None and clock.t - running.since >= 0.05:
            adm.leave(running)
            running = None
        entry = adm.enter(1)
        if entry.admitted:
            running = entry
        return entry

    for _ in range(20_000):  # one request per millisecond
        entry = step()
        if entry.state == "rejected":
            hints.append((int(entry.headers["retry-after-ms"]), int(entry.headers["retry-after"])))
    assert len(hints) > 19_000
    assert max(ms for ms, _ in hints[-5000:]) < 1000  # the last 5 s of the storm: near the real load, not 30 s
    # (whole-second slots the storm itself keeps claiming stay spread up to 30 s while it lasts)
    if running is not None:
        adm.leave(running)
        running = None
    clock.t += 3.0
    while (entry := step()).state != "rejected":
        pass
    assert int(entry.headers["retry-after-ms"]) < 200 and entry.headers["retry-after"] == "1"


def test_clients_that_honour_the_hints_keep_their_slots():
    """Bursts of typesafe-sdk-like clients: every retry comes in its slot and is admitted; the shares stay high."""
    adm, clock = make(wait_s=0.0, service_s=0.1)
    for _ in range(5):
        running = adm.enter(1)
        slots = sorted(slot(adm.enter(1), clock) for _ in range(9))
        for at in slots:
            clock.t = max(clock.t, at)
            adm.leave(running)
            clock.t += 0.002
            running = adm.enter(1, retry=True)
            assert running.admitted and running.claimed
            clock.t += 0.1
        adm.leave(running)
        clock.t += 2.0
    assert adm.ms_share > 0.9 and adm.claims == 45

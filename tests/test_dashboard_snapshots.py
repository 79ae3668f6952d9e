"""SVG snapshots of the dashboard on canned data (pytest-textual-snapshot). Update with --snapshot-update."""

from __future__ import annotations

import pytest

pytest.importorskip("pytest_textual_snapshot")

from basal_local.tui.app import DashboardApp  # noqa: E402

from .dashboard_canned import NOW, T0, CannedSource, batch_event, canned_events, request_events, utc  # noqa: E402, F401  (utc: a fixture)

CLIENTS = ["typesafe-sdk/0.7.5", "basal-client-python", "jev-cli/0.7.0", "python-httpx/0.28.1"]


def busy_events() -> list[dict]:
    """The canned events plus a busy second: 36 more requests in 6 batches, so the big terminals are not empty."""
    events = canned_events()
    for b in range(6):
        rids = [f"req-{100 + 6 * b + n:04d}" for n in range(6)]
        for n, rid in enumerate(rids):
            events += request_events(rid, T0 + 8 + b * 0.25 + n * 0.01, CLIENTS[(b + n) % 4], 10 + b, 6)
        events.append(batch_event(10 + b, T0 + 8.2 + b * 0.25, rids))
    events.sort(key=lambda e: e["ts"])
    for seq, event in enumerate(events, 1):
        event["seq"] = seq
    return events


def app(busy: bool = False, stats: dict | None = None) -> DashboardApp:
    return DashboardApp(CannedSource(busy_events() if busy else None, stats=stats), clock=lambda: NOW, refresh_s=5.0)


async def settle(pilot) -> None:
    await pilot.pause()
    pilot.app.redraw(force=True)
    await pilot.pause()


@pytest.mark.parametrize("size", [(80, 24), (120, 40), (200, 60)], ids=["80x24", "120x40", "200x60"])
@pytest.mark.parametrize("key", ["1", "2", "3", "4", "5"])
def test_views(snap_compare, key, size):
    """Every view at the three sizes: nothing essential cut at 80x24, the panes grown at the larger ones."""

    async def run_before(pilot):
        await pilot.press(key)
        await settle(pilot)

    assert snap_compare(app(busy=size != (80, 24)), terminal_size=size, run_before=run_before)


def test_disconnected_and_paused_at_80x24(snap_compare):
    """The header keeps PAUSED and the reason; the numbers are greyed."""

    async def run_before(pilot):
        await settle(pilot)
        await pilot.press("p")
        pilot.app.clear_notifications()
        pilot.app.daemon_connection(False, "HTTP 502")
        await settle(pilot)

    assert snap_compare(app(), terminal_size=(80, 24), run_before=run_before)


def test_request_detail(snap_compare):
    async def run_before(pilot):
        await pilot.press("2")
        await settle(pilot)
        await pilot.press("down", "down", "down", "down", "enter")
        await pilot.pause(0.2)

    assert snap_compare(app(), terminal_size=(100, 30), run_before=run_before)


@pytest.mark.parametrize("key, size", [("1", (80, 24)), ("1", (120, 40)), ("4", (120, 40))],
                         ids=["1-80x24", "1-120x40", "4-120x40"])
def test_two_replicas_and_a_loading_model(snap_compare, key, size):
    """A model on two GPUs: its lanes, state cache and memory split per replica (one line per GPU at 80x24, all
    of it on screen); a second model loading, a third failed."""

    async def run_before(pilot):
        await pilot.press(key)
        await settle(pilot)

    from .dashboard_canned import run_time_models, two_replicas

    stats = run_time_models(two_replicas())
    assert snap_compare(app(busy=size != (80, 24), stats=stats), terminal_size=size, run_before=run_before)

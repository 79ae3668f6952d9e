"""SVG snapshots of the dashboard on canned data (pytest-textual-snapshot). Update with --snapshot-update."""

from __future__ import annotations

import time

import pytest

pytest.importorskip("pytest_textual_snapshot")

from basal_local.tui.app import DashboardApp  # noqa: E402

from .dashboard_canned import NOW, CannedSource  # noqa: E402


@pytest.fixture(autouse=True)
def utc(monkeypatch):
    monkeypatch.setenv("TZ", "UTC")
    time.tzset()
    yield
    monkeypatch.undo()
    time.tzset()


def app() -> DashboardApp:
    return DashboardApp(CannedSource(), clock=lambda: NOW, refresh_s=5.0)


async def settle(pilot) -> None:
    await pilot.pause()
    pilot.app.redraw(force=True)
    await pilot.pause()


@pytest.mark.parametrize("key", ["1", "2", "3", "5"])
def test_views_at_80x24(snap_compare, key):
    async def run_before(pilot):
        await pilot.press(key)
        await settle(pilot)

    assert snap_compare(app(), terminal_size=(80, 24), run_before=run_before)


def test_request_detail(snap_compare):
    async def run_before(pilot):
        await pilot.press("2")
        await settle(pilot)
        await pilot.press("down", "down", "down", "down", "enter")
        await pilot.pause(0.2)

    assert snap_compare(app(), terminal_size=(100, 30), run_before=run_before)

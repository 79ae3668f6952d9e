"""The dashboard under traffic, driven by Pilot on canned data: lists that follow their top until the user moves
the cursor, a disconnect that greys the numbers, one toast at a time, the key bar and header at 80 columns, the log
backlog and the access log, and `serve --tui` without a terminal."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytest.importorskip("textual")

from basal_local.tui.app import DashboardApp  # noqa: E402
from basal_local.tui.data import DashboardData  # noqa: E402
from basal_local.tui.screens.help import HelpScreen  # noqa: E402
from basal_local.tui.widgets.keybar import keys_text  # noqa: E402
from basal_local.tui.widgets.status import status_text  # noqa: E402

from .conftest import free_port  # noqa: E402
from .dashboard_canned import NOW, STATS, T0, CannedSource, batch_event, request_events, screen_text, utc  # noqa: E402, F401  (utc: a fixture)


def make_app(**kw) -> DashboardApp:
    return DashboardApp(CannedSource(**kw.pop("source", {})), clock=lambda: NOW, **kw)


async def settle(pilot, app) -> None:
    await pilot.pause()
    app.redraw(force=True)
    await pilot.pause()


def feed(app, events) -> None:
    for event in events:
        app.daemon_event(event)


def ids_of(table) -> list[str]:
    return [str(table.get_row_at(i)[0]) for i in range(table.row_count)]


async def test_requests_follow_the_top_until_the_cursor_moves_and_home_brings_it_back():
    app = make_app()
    async with app.run_test(size=(80, 24)) as pilot:
        await pilot.press("2")
        await settle(pilot, app)
        table = app.screen.query_one("#requests")
        feed(app, request_events("req-0100", T0 + 8, "curl/8", 3, 1))
        await settle(pilot, app)
        # sorted by time, newest first, and the view shows the top: the new request, with the cursor on it
        assert ids_of(table)[0] == "req-0100" and table.cursor_row == 0 and table.scroll_y == 0
        await pilot.press("down", "down")
        await settle(pilot, app)
        held = ids_of(table)
        selected = app.screen.selected_id()
        feed(app, request_events("req-0101", T0 + 9, "curl/8", 4, 1))
        app.redraw(force=True)
        await pilot.press("down")  # a keypress in between redraws under traffic: it still moves from where it was
        feed(app, request_events("req-0102", T0 + 9.5, "curl/8", 4, 1))
        await settle(pilot, app)
        assert ids_of(table) == held and table.cursor_row == 3  # the rows held still, the cursor went on
        assert app.screen.selected_id() == held[3] != selected
        assert "held: 2 new, Home goes to the top" in screen_text(app)
        await pilot.press("home")
        await settle(pilot, app)
        assert ids_of(table)[:2] == ["req-0102", "req-0101"] and table.cursor_row == 0
        assert "held" not in screen_text(app)


async def test_sort_shows_the_top_of_the_new_order():
    app = make_app()
    async with app.run_test(size=(80, 24)) as pilot:
        await pilot.press("2")
        await settle(pilot, app)
        table = app.screen.query_one("#requests")
        await pilot.press("down", "down", "down", "down")
        await settle(pilot, app)
        await pilot.press("s")  # by queue ms, largest first
        await settle(pilot, app)
        assert table.cursor_row == 0 and table.scroll_y == 0
        assert set(ids_of(table)[:2]) == {"req-0003", "req-0004"}  # queue 14 ms
        assert "sorted by queue ms" in screen_text(app)


async def test_batches_hold_still_under_traffic_and_never_snap_back():
    app = make_app()
    async with app.run_test(size=(80, 24)) as pilot:
        await pilot.press("3")
        feed(app, [batch_event(n, T0 + 6 + n / 100, [f"req-b{n}"]) for n in range(10, 20)])
        await settle(pilot, app)
        table = app.screen.query_one("#batches")
        tree = app.screen.query_one("#tree")
        assert ids_of(table)[0] == "19" and tree.root.label.plain.startswith("batch 19")
        await pilot.press("down")
        for n in range(20, 30):  # heavy traffic between the two presses: a redraw after every batch
            app.daemon_event(batch_event(n, T0 + 7 + n / 100, [f"req-b{n}"]))
            app.redraw(force=True)
        await pilot.press("down")
        for n in range(30, 35):
            app.daemon_event(batch_event(n, T0 + 8 + n / 100, [f"req-b{n}"]))
            await settle(pilot, app)
        assert table.cursor_row == 2 and ids_of(table)[:3] == ["19", "18", "17"]
        assert tree.root.label.plain.startswith("batch 17")
        assert "newer batches above" in screen_text(app)
        await pilot.press("home")
        await settle(pilot, app)
        assert ids_of(table)[0] == "34" and tree.root.label.plain.startswith("batch 34")


async def test_a_disconnect_greys_the_numbers():
    app = make_app()
    async with app.run_test(size=(80, 24)) as pilot:
        await settle(pilot, app)
        label = app.screen.query_one("#kpi-rps").query_one("Label")
        live_color = label.styles.color
        app.daemon_connection(False, "HTTP 502")
        await settle(pilot, app)
        assert app.screen.has_class("-disconnected")
        grey = label.styles.color
        assert grey != live_color and grey.a < live_color.a  # $text-disabled: the text colour, faded
        assert app.screen.query_one("#queues").styles.color == grey
        text = screen_text(app)
        assert "DISCONNECTED" in text and "retrying: HTTP 502" in text
        app.daemon_connection(True)
        await settle(pilot, app)
        assert not app.screen.has_class("-disconnected") and label.styles.color == live_color


async def test_toasts_replace_each_other():
    app = make_app()
    async with app.run_test(size=(80, 24)) as pilot:
        await pilot.press(*["plus"] * 6, *["minus"] * 4, "p", "p", "c")
        await pilot.pause()
        assert len(app._notifications) == 1  # noqa: SLF001 (Textual keeps the toasts there)


async def test_q_under_serve_tui_says_it_stops_the_daemon():
    app = make_app(owns_daemon=True)
    async with app.run_test(size=(80, 24)) as pilot:
        for key in ("1", "2", "3", "4", "5"):
            await pilot.press(key)
            await settle(pilot, app)
            assert "q quit + stop daemon" in screen_text(app).splitlines()[-1], key
        await pilot.press("question_mark")
        await pilot.pause()
        assert isinstance(app.screen, HelpScreen) and "stops the daemon too" in screen_text(app)
    plain = make_app()
    async with plain.run_test(size=(80, 24)) as pilot:
        await settle(pilot, plain)
        assert "stop daemon" not in screen_text(plain) and " q quit" in screen_text(plain)


def test_header_and_key_bar_fit_80_columns_with_paused_and_the_reason():
    data = DashboardData(clock=lambda: NOW, url="http://127.0.0.1:8000")
    data.load_stats(dict(STATS))
    data.set_connected(False, "connection refused (is the daemon running?)")
    text = status_text(data, paused=True, width=80)
    assert text.cell_len <= 80 and "PAUSED" in text.plain and "DISCONNECTED" in text.plain
    assert "retrying: connection refused" in text.plain
    data.set_connected(True)
    text = status_text(data, paused=True, width=80)
    assert text.cell_len <= 80 and text.plain.rstrip().endswith("PAUSED") and "ready" in text.plain
    assert "basal-demo" in text.plain and "up 1h02m" in text.plain
    keys = keys_text([("Enter", "open"), ("/", "filter"), ("s", "sort"), ("Home", "top")], 60, owns_daemon=True)
    assert keys.cell_len <= 60 and "q quit + stop daemon" in keys.plain and "Enter open" in keys.plain
    assert "speed" not in keys.plain  # the least needed key went first


async def test_log_view_backlog_in_time_order_and_the_access_log():
    backlog = [{"seq": 1, "ts": T0 - 30, "kind": "log", "level": "INFO", "logger": "basal_local.daemon",
                "message": "loading model 1/1 from /models/demo"},
               {"seq": 2, "ts": T0 - 20, "kind": "log", "level": "INFO", "logger": "basal_local.daemon",
                "message": "loaded basal-demo from /models/demo"}]
    app = make_app(source={"stats": dict(STATS, log=backlog)})
    async with app.run_test(size=(100, 32)) as pilot:
        app.data.add_log(type(app.data.log[0])(T0 - 25, "INFO", "daemon", "ready: basal-demo"))  # printed late
        await pilot.press("5")
        await settle(pilot, app)
        lines = screen_text(app).splitlines()
        order = [next(i for i, line in enumerate(lines) if word in line)
                 for word in ("loading model", "ready: basal-demo", "loaded basal-demo", "connected to")]
        assert order == sorted(order)  # in time order, the backlog before the dashboard's own line
        assert "access:" not in "".join(lines[2:-1])
        await pilot.press("a")
        await settle(pilot, app)
        text = screen_text(app)
        assert "access log shown" in text
        assert "access: 200 systemone typesafe-sdk 2 q 61 ms req-0000" in text
        assert "access: 529 systemone curl - q - ms req-0006" in text


def test_serve_tui_without_a_terminal_refuses_in_one_sentence(tmp_path, tiny_model):
    env = dict(os.environ, BASAL_LOCAL_HOME=str(tmp_path), NO_COLOR="1")
    command = ["serve", "--model", str(tiny_model), "--tui", "--port", str(free_port())]
    proc = subprocess.run([sys.executable, "-m", "basal_local.cli", *command],
                          stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 2
    assert proc.stderr.strip().count("\n") == 0 and "needs a terminal" in proc.stderr
    assert "\x1b" not in proc.stdout + proc.stderr and "Traceback" not in proc.stderr
    assert "without --tui" in proc.stderr
    # `top` is told what fits `top`, not to drop a --tui it never had
    top = subprocess.run([sys.executable, "-m", "basal_local.cli", "top"], stdin=subprocess.DEVNULL,
                         capture_output=True, text=True, timeout=120, env=env)
    assert top.returncode == 2 and "needs a terminal" in top.stderr and "--tui" not in top.stderr, top.stderr

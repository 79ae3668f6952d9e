"""The dashboard driven by Pilot on canned daemon data: every view and every key, no server, no clock."""

from __future__ import annotations

import pytest

pytest.importorskip("textual")

from basal_local.tui.app import REFRESH_STEPS, DashboardApp  # noqa: E402
from basal_local.tui.data import DashboardData, client_name  # noqa: E402
from basal_local.tui.screens.batches import BatchesScreen  # noqa: E402
from basal_local.tui.screens.detail import RequestDetailScreen  # noqa: E402
from basal_local.tui.screens.help import HelpScreen  # noqa: E402
from basal_local.tui.screens.log import LogScreen  # noqa: E402
from basal_local.tui.screens.models import ModelsScreen  # noqa: E402
from basal_local.tui.screens.overview import OverviewScreen  # noqa: E402
from basal_local.tui.screens.requests import RequestsScreen  # noqa: E402

from .dashboard_canned import NOW, T0, CannedSource, canned_events, screen_text, utc  # noqa: E402, F401

SIZE = (100, 32)


def make_app(**kw) -> tuple[DashboardApp, CannedSource]:
    source = CannedSource(**kw)
    return DashboardApp(source, clock=lambda: NOW), source


async def settle(pilot, app) -> None:
    await pilot.pause()
    app.redraw(force=True)
    await pilot.pause()


async def test_overview_header_kpis_queue_and_memory():
    app, _ = make_app()
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot, app)
        assert isinstance(app.screen, OverviewScreen)
        text = screen_text(app)
        assert "ready" in text and "torch/cpu/f32" in text and "basal-demo" in text and "up 1h02m" in text
        assert "http://127.0.0.1:8000" in text
        # requests/s over the last 5 whole seconds, counted here from the canned events
        answered = [e for e in canned_events() if e["kind"] == "answered" and NOW - 5 <= e["ts"] < int(NOW)]
        assert f"{len(answered) / 5:.1f}" == app.screen.query_one("#kpi-rps").query_one("Label").content
        decisions = sum(e["questions"] for e in answered) / 5
        assert f"{decisions:.1f}" in text
        assert "1 / 1024" in text  # in flight vs limit
        assert "batch 3: 4 req" in text and "35 ms" in text  # the running batch and the oldest wait
        # the device pane (telemetry/device.py's sample) and the backend's memory figures
        assert "GPU0 NVIDIA H200  util 87 %  412/700 W  1980 MHz" in text and "24.0/140.0 GiB" in text
        # used 24 GiB = weights 8.5 + graphs 1.5 + state cache 6.0 + other 8.0 (the canned backend figures)
        assert "weights 8.5 GiB  graphs 1.5 GiB  cache 6.0 GiB  other 8.0 GiB  free 116.0 GiB" in text
        assert "cpu 112 % of 16 cores  RSS 512.0 MiB" in text
        # the state cache in one line (32 lines): 412 hits of 562 lookups, 1,234,567 tokens continued
        assert "state cache hit 73 % 412/562  1.2M tok saved  6.0/12.0 GiB  37 nodes  9 evicted" in text
        assert "529 overloaded" in text
        # the daemon's totals, which add up to received
        assert "received 8  answered 5  failed 0  rejected 1  529 1  cancelled 0  in flight 1" in text


async def test_requests_table_newest_first_sort_and_filter():
    app, _ = make_app()
    async with app.run_test(size=(120, 32)) as pilot:  # every column fits
        await pilot.press("2")
        await settle(pilot, app)
        screen = app.screen
        table = screen.query_one("#requests")
        ids = [str(table.get_row_at(i)[0]) for i in range(table.row_count)]
        assert ids == [f"req-{n:04d}" for n in range(6, -1, -1)]  # newest first
        row = {c.key.value: str(v) for c, v in zip(table.ordered_columns, table.get_row_at(ids.index("req-0003")))}
        assert row["client"] == "httpx" and row["model"] == "basal-demo" and row["batch_id"] == "2"
        assert row["queue_ms"] == "14" and row["compute_ms"] == "44" and row["status"] == "200"
        assert row["input_tokens"] == "480" and row["questions"] == "2"
        await pilot.press("s")  # by queue ms, largest first
        await pilot.pause()
        assert "sorted by queue ms" in screen_text(app)
        first = [str(table.get_row_at(i)[0]) for i in range(2)]
        assert set(first) == {"req-0003", "req-0004"}  # queue 14 ms beat 13 ms
        await pilot.press("slash")
        await pilot.pause()
        assert screen.query_one("#filter").has_focus
        await pilot.press(*"curl")
        await pilot.pause()
        assert table.row_count == 2  # the two curl requests
        await pilot.press("enter")  # keep the filter, back to the table
        await pilot.pause()
        assert table.has_focus and table.row_count == 2
        await pilot.press("escape")  # clears it
        await pilot.pause()
        assert table.row_count == 7
        await pilot.press("slash", *">61", "enter")
        await pilot.pause()
        assert sorted(str(table.get_row_at(i)[0]) for i in range(table.row_count)) == ["req-0003", "req-0004"]


async def test_enter_opens_a_request_with_bars_confidence_and_timings():
    app, source = make_app()
    async with app.run_test(size=(110, 40)) as pilot:
        await pilot.press("2")
        await settle(pilot, app)
        await pilot.press("down", "down", "down", "down")  # req-0002
        await pilot.press("enter")
        await pilot.pause(0.2)
        assert isinstance(app.screen, RequestDetailScreen)
        assert source.asked == ["req-0002"]
        text = screen_text(app)
        assert "Uszkodzenie" in text and "97.0 %" in text and "3.0 %" in text
        assert "30.0 %" in text and "70.0 %" in text  # noul 0.3: yes and no
        assert "confidence 0.970" in text and "\u2713 1 % error needs 0.955" in text
        assert "\u2717 1 % error needs 0.955" in text  # the noul answer, confidence 0.7, meets neither
        assert "queue 13" in text and "compute 44" in text and "total 61" in text
        await pilot.press("escape")
        await pilot.pause()
        assert isinstance(app.screen, RequestsScreen)


async def test_batches_view_shows_the_tree_with_tokens_and_owners():
    app, _ = make_app()
    async with app.run_test(size=SIZE) as pilot:
        await pilot.press("3")
        await settle(pilot, app)
        tree = app.screen.query_one("#tree")
        assert tree.root.label.plain.startswith("batch 2")
        batch = next(e for e in canned_events() if e.get("batch_id") == 2 and e["kind"] == "computed")
        assert f"{batch['packed_tokens']}/{batch['unpacked_tokens']:,} tok" in tree.root.label.plain
        # batch 2 asks about a document the state cache holds: the row continues template (57) + state (100)
        row = tree.root.children[0]
        assert row.label.plain == "row 0 [pl] \u21ba 157 tok from the state cache + 94 tok, 8 prompts"
        [cached] = row.children  # the cached block, marked, with the computed questions below it
        assert cached.label.plain == "\u21ba template + state 157 tok  cached: not computed in this batch"
        question = cached.children[0]
        assert question.label.plain == "question 14 tok"
        assert [leaf.label.plain for leaf in question.children] == ["order 6 tok  \u2190 req-0003:kind#0",
                                                                   "order 6 tok  \u2190 req-0003:kind#1"]
        assert len(cached.children) == 4  # two questions for each of the two requests
        saved = 100 * (1 - batch["packed_tokens"] / batch["unpacked_tokens"])
        text = screen_text(app)
        assert f"{saved:.0f} % saved" in text
        assert " 2 \u21ba " in text and " 1 \u21ba " not in text  # the list marks the batch that hit the cache
        await pilot.press("down")  # the older batch: no state cached, only the template
        await pilot.pause()
        assert tree.root.label.plain.startswith("batch 1")
        row = tree.root.children[0]
        assert "cached template 57 tok" in row.label.plain and "\u21ba" not in row.label.plain
        states = row.children
        assert [s.label.plain for s in states] == ["state 100 tok", "state 110 tok", "state 120 tok"]


async def test_models_and_log_views():
    app, _ = make_app()
    async with app.run_test(size=SIZE) as pilot:
        await pilot.press("4")
        await settle(pilot, app)
        text = screen_text(app)
        assert "/models/demo" in text and "8192 tokens/batch" in text and "1 % error: 0.955" in text
        # the format and the calibration file in use (/api/stats models[i]["port"], model/formats.py)
        assert "format                   bf16, 16-bit" in text and "calibration file         CALIBRATION.json" in text
        await pilot.press("5")
        await settle(pilot, app)
        text = screen_text(app)
        assert "loaded basal-demo" in text and "req-0005 422" in text and "req-0006 529" in text


async def test_pause_freezes_the_display_and_resume_catches_up():
    app, _ = make_app()
    async with app.run_test(size=SIZE) as pilot:
        await pilot.press("2")
        await settle(pilot, app)
        table = app.screen.query_one("#requests")
        await pilot.press("p")
        assert app.paused
        app.daemon_event({"kind": "received", "ts": T0 + 9, "id": "req-late", "endpoint": "basal", "client": ""})
        app.tick()
        await pilot.pause()
        assert table.row_count == 7 and "PAUSED" in screen_text(app)
        await pilot.press("p")
        app.tick()
        await pilot.pause()
        assert not app.paused and table.row_count == 8


async def test_plus_minus_change_the_refresh_period():
    app, _ = make_app()
    async with app.run_test(size=SIZE) as pilot:
        assert app.refresh_s == 0.5
        await pilot.press("plus")
        assert app.refresh_s == 0.25
        await pilot.press("plus")
        assert app.refresh_s == REFRESH_STEPS[0]
        await pilot.press("minus", "minus", "minus")
        assert app.refresh_s == 2.0


async def test_help_opens_and_closes_and_q_quits():
    app, _ = make_app()
    async with app.run_test(size=SIZE) as pilot:
        await pilot.press("question_mark")
        await pilot.pause()
        assert isinstance(app.screen, HelpScreen) and "filter requests" in screen_text(app)
        await pilot.press("escape")
        await pilot.pause()
        assert isinstance(app.screen, OverviewScreen)
        await pilot.press("q")
        await pilot.pause()
        assert app.return_code == 0 and not app.is_running


async def test_disconnected_daemon_is_said_in_words():
    app, _ = make_app(connected=False)
    async with app.run_test(size=(80, 24)) as pilot:
        await settle(pilot, app)
        text = screen_text(app)
        assert "DISCONNECTED" in text and "retrying" in text
        app.daemon_connection(True)
        await pilot.pause()
        assert "DISCONNECTED" not in screen_text(app)


async def test_number_keys_switch_views_and_back_and_every_view_fits_80x24():
    """One app for both checks (an app start and each first visit of a view parse the stylesheets again)."""
    app, _ = make_app()
    async with app.run_test(size=(80, 24)) as pilot:
        for key, kind in [("1", OverviewScreen), ("2", RequestsScreen), ("3", BatchesScreen), ("4", ModelsScreen),
                          ("5", LogScreen), ("1", OverviewScreen)]:
            await pilot.press(key)
            await settle(pilot, app)
            assert isinstance(app.screen, kind), key
            lines = screen_text(app).splitlines()
            assert len(lines) == 24 and "quit" in lines[-1], key  # the footer is on screen


def test_no_color_is_respected(monkeypatch):
    monkeypatch.setenv("NO_COLOR", "1")
    app, _ = make_app()
    assert app.no_color


def test_client_names_from_user_agents():
    assert client_name("typesafe-sdk/0.7.5") == "typesafe-sdk"
    assert client_name("basal-client-python") == "basal-client"
    assert client_name("jev-cli/0.7.0") == "jev-cli"
    assert client_name("Python/3.11 aiohttp/3.9.5") == "aiohttp"
    assert client_name("python-httpx/0.28.1") == "httpx"
    assert client_name("") == "-"


def test_data_rates_and_percentiles_from_event_times():
    data = DashboardData(clock=lambda: NOW)
    for event in canned_events():
        data.apply(event)
    assert data.series("requests", 10) == [3, 0, 0, 0, 0, 2, 0, 0, 0, 0]
    assert data.series("overloaded", 10)[7] == 1
    assert data.latency(0, 50) == 13.0 and data.latency(1, 95) == 44.5
    assert data.requests["req-0001"]["status"] == 200 and data.requests["req-0005"]["status"] == 422


def test_cli_top_and_serve_flags():
    from basal_local.addresses import local_url
    from basal_local.cli import build_parser, cmd_serve, cmd_top

    args = build_parser().parse_args(["top", "--url", "http://127.0.0.1:9"])
    assert args.func is cmd_top and args.url == "http://127.0.0.1:9"
    args = build_parser().parse_args(["serve", "--demo", "--tui", "--demo-traffic"])
    assert args.func is cmd_serve and args.tui and args.demo_traffic and args.demo
    assert local_url("0.0.0.0", 8000) == "http://127.0.0.1:8000" and local_url("::1", 80) == "http://[::1]:80"


async def test_c_clears_the_dashboards_stats_but_not_the_daemons():
    app, _ = make_app()
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot, app)
        text = screen_text(app)
        assert "1 (+1 4xx)" not in text and "0 (+1 4xx)" in text  # before: the daemon's totals
        assert sum(app.data.series("requests", 10)) == 5 and app.data.batch_sizes == {3: 1, 2: 1}
        app.daemon_event({"kind": "received", "ts": NOW - 0.5, "id": "req-live", "endpoint": "basal", "client": ""})
        await pilot.press("c")
        await settle(pilot, app)
        # counters since the clear: the daemon's totals minus the baseline; rates, sparklines, percentiles gone
        assert app.data.total("rejected") == 0 and app.data.total("overloaded") == 0
        assert app.screen.query_one("#kpi-errors").query_one("Label").content == "0 (+0 4xx)"
        assert app.screen.query_one("#kpi-overloaded").query_one("Label").content == "0"
        assert app.data.series("requests", 10) == [0] * 10 and app.data.latency(0, 50) is None
        assert app.data.batch_sizes == {} and not app.data.batches
        assert list(app.data.requests) == ["req-live"]  # the one still in flight stays
        assert app.data.stats["totals"]["rejected"] == 1  # the daemon's own figure is untouched
        # a later 529 counts from the new baseline
        stats = dict(app.data.stats, totals=dict(app.data.stats["totals"], overloaded=3))
        app.daemon_stats(stats)
        await settle(pilot, app)
        assert app.screen.query_one("#kpi-overloaded").query_one("Label").content == "2"
        await pilot.press("question_mark")
        await pilot.pause()
        assert "clear stats" in screen_text(app) and "untouched" in screen_text(app)


async def test_log_level_filter_and_follow():
    app, _ = make_app()
    async with app.run_test(size=SIZE) as pilot:
        await pilot.press("5")
        await settle(pilot, app)
        screen = app.screen
        for n, level in enumerate(["DEBUG", "INFO", "WARNING", "ERROR"]):
            app.daemon_event({"kind": "log", "ts": T0 + 9 + n / 10, "level": level, "logger": "basal_local.x",
                              "message": f"message at {level.lower()}"})
        await settle(pilot, app)
        text = screen_text(app)
        assert "level \u2265 DEBUG" in text and "following" in text
        assert all(f"message at {lv}" in text for lv in ("debug", "info", "warning", "error"))
        await pilot.press("l")  # INFO and up
        await settle(pilot, app)
        text = screen_text(app)
        assert "level \u2265 INFO" in text and "message at debug" not in text and "message at info" in text
        await pilot.press("l", "l")  # ERROR only
        await settle(pilot, app)
        text = screen_text(app)
        assert "level \u2265 ERROR" in text and "message at warning" not in text and "message at error" in text
        assert "req-0005 422" not in text  # a 422 is a WARNING line
        await pilot.press("l")  # back round to DEBUG
        await settle(pilot, app)
        assert "message at debug" in screen_text(app)
        log = screen.query_one("#log")
        await pilot.press("f")
        await settle(pilot, app)
        assert not screen.follow and not log.auto_scroll and "HOLDING" in screen_text(app)
        for n in range(40):  # more than the pane shows: holding, the view stays where it was
            app.daemon_event({"kind": "log", "ts": T0 + 9.5, "level": "INFO", "logger": "x", "message": f"flood {n}"})
        await settle(pilot, app)
        text = screen_text(app)
        assert "40 new line(s) below" in text and "flood 39" not in text
        await pilot.press("f")
        await settle(pilot, app)
        assert screen.follow and log.auto_scroll and "flood 39" in screen_text(app)


async def test_batches_view_histogram_of_requests_per_batch():
    app, _ = make_app()
    async with app.run_test(size=SIZE) as pilot:
        await pilot.press("3")
        await settle(pilot, app)
        from basal_local.tui.screens.batches import SIZE_BUCKETS

        sizes = app.screen.query_one("#sizes")
        # the canned batches: one of 3 requests, one of 2; then four more of sizes 1, 5, 8 and 70
        for n, size in enumerate([1, 5, 8, 70]):
            app.daemon_event({"kind": "computed", "ts": T0 + 9, "batch_id": 10 + n, "model": "m", "lane": "main",
                              "requests": size, "questions": size, "packed_tokens": 10, "unpacked_tokens": 20,
                              "tree": []})
        await settle(pilot, app)
        expected = {"1": 1, "2": 1, "3-4": 1, "5-8": 2, "9-16": 0, "17-32": 0, "33-64": 0, "65+": 1}
        assert len(SIZE_BUCKETS) == len(expected)
        lines = [line.strip(" \u2502") for line in screen_text(app).splitlines()]
        for label, count in expected.items():
            assert any(line.split()[:1] == [label] and line.split()[-1] == str(count) for line in lines), label
        assert sizes.border_subtitle == f"mean {(3 + 2 + 1 + 5 + 8 + 70) / 6:.1f} of 6"


async def test_tree_names_multi_branches_and_large_choice_rounds():
    app, _ = make_app()

    def leaf(qid, order, unit):
        return {"tokens": 3, "start": 0, "kind": "order", "owners": [["req-u", qid, order, unit]]}

    branch = {"tokens": 8, "start": 0, "kind": "question", "unit": "multi: damage",
              "children": [leaf("labels", 0, "multi: damage"), leaf("labels", 1, "multi: damage")]}
    event = {"kind": "computed", "ts": T0 + 9, "batch_id": 42, "model": "m", "lane": "main", "requests": 1,
             "questions": 2, "packed_tokens": 100, "unpacked_tokens": 300, "compute_ms": 5.0,
             "tree": [{"lang": "en", "prefix": "en", "prefix_tokens": 50, "tokens": 100, "prompts": 4,
                       "children": [{"tokens": 80, "start": 0, "kind": "state",
                                     "children": [branch, leaf("big", 0, "round 1, group 2")]}]}]}
    async with app.run_test(size=(120, 40)) as pilot:
        app.daemon_event(event)
        await pilot.press("3")
        await settle(pilot, app)
        tree = app.screen.query_one("#tree")
        assert tree.root.label.plain.startswith("batch 42")
        state = tree.root.children[0].children[0]
        question, group = state.children
        assert question.label.plain == "question 8 tok  multi: damage"
        # the question block names the branch; its leaves need not say it again
        assert question.children[0].label.plain == "order 3 tok  \u2190 req-u:labels#0"
        assert group.label.plain == "order 3 tok  \u2190 req-u:big#0 (round 1, group 2)"


async def test_a_failed_batch_is_cleared_from_the_queue_panel():
    app, _ = make_app()
    async with app.run_test(size=SIZE) as pilot:
        app.daemon_event({"kind": "batched", "ts": T0 + 9, "batch_id": 9, "model": "basal-demo", "lane": "long",
                          "request_ids": ["req-x"], "tokens": 5000})
        await settle(pilot, app)
        assert "batch 9: 1 req" in screen_text(app)
        app.daemon_event({"kind": "batch_failed", "ts": T0 + 9.5, "batch_id": 9, "model": "basal-demo",
                          "lane": "long", "error": "RuntimeError: device lost"})
        await settle(pilot, app)
        assert "batch 9" not in screen_text(app) and app.data.running == {}
        await pilot.press("5")
        await settle(pilot, app)
        assert "ERROR   engine: batch 9 failed in basal-demo/long: RuntimeError: device" in screen_text(app)


async def test_ctrl_c_quits_as_the_banner_says():
    app, _ = make_app()
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot, app)
        assert app.return_code is None
        await pilot.press("ctrl+c")
        await pilot.pause()
        assert app.return_code == 0  # the app is leaving (q's action), not showing "press ctrl+q"


def test_totals_show_the_running_batch_jobs():
    from basal_local.tui.screens.overview import totals_text

    data = DashboardData(clock=lambda: NOW)
    data.stats = {"totals": {}, "batch_jobs": [{"id": "batch_1", "status": "in_progress", "total": 50000,
                                                "completed": 1200, "failed": 34},
                                               {"id": "batch_2", "status": "validating", "total": 0}]}
    assert "batch 1,234/50,000 in_progress +1" in totals_text(data).plain
    data.stats = {"totals": {}}
    assert "batch" not in totals_text(data).plain


async def test_a_tall_overview_lists_each_batch_job_with_its_progress():
    import copy

    from .dashboard_canned import STATS

    stats = copy.deepcopy(STATS)
    stats["batch_jobs"] = [{"id": f"batch_{n}", "status": "in_progress", "total": 1000, "completed": 100 * n,
                            "failed": n} for n in range(1, 7)]
    app, _ = make_app(stats=stats)
    async with app.run_test(size=(120, 40)) as pilot:
        await settle(pilot, app)
        text = screen_text(app)
        # batch_2: 200 + 2 of 1,000 lines = 20 %; four listed, the other two counted
        line = next(s for s in text.splitlines() if "batch batch_2" in s)
        assert "in_progress" in line and " 20 %  202/1,000 lines, 2 failed" in line
        assert "batch batch_4" in text and "batch batch_5" not in text and "+2 more batches" in text

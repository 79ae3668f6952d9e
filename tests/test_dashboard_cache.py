"""The dashboard's state cache, memory split and model states on canned data: the cache pane (one line, a table per
model or replica), the cached blocks' marks, the GPU memory by weights / graphs / cache / other / free, models
loading and unloading, and the graphs' memory meter of the torch backend."""

from __future__ import annotations

import copy

import pytest

pytest.importorskip("textual")

from basal_local.tui.app import DashboardApp  # noqa: E402
from basal_local.tui.data import DashboardData  # noqa: E402
from basal_local.tui.widgets.cache import cache_line  # noqa: E402
from basal_local.tui.widgets.device import memory_split  # noqa: E402
from basal_local.tui.widgets.status import status_text  # noqa: E402

from .dashboard_canned import (  # noqa: E402, F401  (utc: a fixture)
    CACHE,
    NOW,
    STATS,
    CannedSource,
    run_time_models,
    screen_text,
    two_replicas,
    utc,
)

GiB = 2**30


def make_app(stats=None) -> DashboardApp:
    return DashboardApp(CannedSource(stats=stats), clock=lambda: NOW)


async def settle(pilot, app) -> None:
    await pilot.pause()
    app.redraw(force=True)
    await pilot.pause()


def line_of(text: str, start: str) -> str:
    return next(line for line in text.splitlines() if line.strip("│ ").startswith(start)).strip("│ ")


async def test_cache_table_at_120x40_per_model():
    app = make_app()
    async with app.run_test(size=(120, 40)) as pilot:
        await settle(pilot, app)
        text = screen_text(app)
        assert "state cache" in text and "cache setting auto" in text
        row = line_of(text[text.index("state cache"):], "basal-demo  ")
        # 6 of 12 GiB, 37 nodes, 48,213 tokens, 412 hits, 150 misses: 412/562 = 73.3 %, 1,234,567 hit tokens
        assert row.split()[0] == "basal-demo" and "\u2588" in row.split()[1]  # the memory bar, half full
        assert row.split()[2:] == ["6.0/12.0", "GiB", "37", "48.2k", "412", "150", "73", "%", "-", "1.2M", "9"]


async def test_two_replicas_each_with_its_cache_and_its_gpu():
    app = make_app(two_replicas())
    async with app.run_test(size=(120, 44)) as pilot:
        await settle(pilot, app)
        text = screen_text(app)
        r0, r1 = line_of(text, "basal-demo/r0"), line_of(text, "basal-demo/r1")
        assert "6.0/12.0 GiB" in r0 and " 412 " in r0 and " 73 % " in r0
        # replica 1: 2 of 12 GiB, 88 hits of 208 lookups = 42.3 %, none evicted
        assert "2.0/12.0 GiB" in r1 and " 88 " in r1 and " 120 " in r1 and " 42 % " in r1 and r1.endswith(" 0")
        # each GPU's memory split by the replica on it: GPU1 holds 2 GiB of cache, 20 GiB used in all
        assert "GPU0 NVIDIA H200" in text and "GPU1 NVIDIA H200" in text
        gpu1 = text[text.index("GPU1"):]
        assert line_of(gpu1, "cache").split()[-2:] == ["2.0", "GiB"]
        assert line_of(gpu1, "other").split()[-2:] == ["8.0", "GiB"]  # 20 - 8.5 - 1.5 - 2.0
        await pilot.press("4")
        await settle(pilot, app)
        text = screen_text(app)
        # the model's cache is both replicas' added up: 8 of 24 GiB, 500 hits of 770 lookups (65 %)
        assert "8.0/24.0 GiB, 48 nodes, 63.2k tokens; hits 500/770 (65 %), 1.5M tokens continued, 9 evicted" in text
        assert "replica 0                cuda:0: cache 6.0/12.0 GiB, 37 nodes; hits 412/562 (73 %), 9 evicted" in text
        assert "replica 1                cuda:1: cache 2.0/12.0 GiB, 11 nodes; hits 88/208 (42 %), 0 evicted" in text


def test_memory_split_adds_up_to_the_gpu():
    gpu = STATS["device_telemetry"]["gpus"][0]
    parts = memory_split(gpu, STATS["memory"])
    assert [name for name, _, _ in parts] == ["weights", "graphs", "cache", "other", "free"]
    assert sum(n for _, n, _ in parts) == gpu["memory_total_bytes"]
    assert dict((name, n) for name, n, _ in parts)["other"] == 24 * GiB - (8.5 + 1.5 + 6) * GiB
    # an older daemon (no graphs, no cache figures): weights, other and free
    old = memory_split(gpu, {"weights_bytes": 3 * 2**20})
    assert [name for name, _, _ in old] == ["weights", "other", "free"]


def test_cache_line_recent_hit_rate_from_the_stats_polls():
    clock = [NOW]
    data = DashboardData(clock=lambda: clock[0])
    data.load_stats(copy.deepcopy(STATS))
    assert data.recent_hit_rate("basal-demo") is None  # one poll: nothing to compare yet
    later = copy.deepcopy(STATS)
    later["models"][0]["prefix_cache"].update(hits=412 + 40, misses=150 + 10)
    clock[0] += 5
    data.load_stats(later)
    assert data.recent_hit_rate("basal-demo") == pytest.approx(40 / 50)
    line = cache_line(data).plain
    assert line.startswith("state cache hit 74 % 452/612 now 80 %")  # 452/612 = 73.9 % over the whole run
    # a restarted daemon counts from 0: no negative rate
    restarted = copy.deepcopy(STATS)
    restarted["models"][0]["prefix_cache"].update(hits=3, misses=1)
    clock[0] += 1
    data.load_stats(restarted)
    assert data.recent_hit_rate("basal-demo") is None


@pytest.mark.parametrize("cache, engine_setting, line, models_line", [
    ({**CACHE, "enabled": False, "setting": "off"}, "off", "state cache off", "state cache              setting off"),
    ({**CACHE, "enabled": False, "setting": "auto"}, "auto", "state cache off (setting auto)",
     "state cache              setting auto"),
    (None, True, "state cache not reported by this daemon", "state cache              setting on (the chat template only)"),  # an older daemon
])
async def test_cache_off_and_an_older_daemon(cache, engine_setting, line, models_line):
    stats = copy.deepcopy(STATS)
    model = stats["models"][0]
    model["engine"]["prefix_cache"] = engine_setting
    if cache is None:
        del model["prefix_cache"]
        del model["replicas"]
    else:
        model["prefix_cache"] = cache
    app = make_app(stats)
    async with app.run_test(size=(100, 32)) as pilot:
        await settle(pilot, app)
        assert line in screen_text(app)
        await pilot.press("4")
        await settle(pilot, app)
        assert models_line in screen_text(app)


async def test_models_loading_unloading_and_failed():
    app = make_app(run_time_models())
    async with app.run_test(size=(100, 40)) as pilot:
        await settle(pilot, app)
        assert " loading basal-4.5B " in screen_text(app).splitlines()[0]
        await pilot.press("4")
        await settle(pilot, app)
        text = screen_text(app)
        assert "keep alive               300 s (unloads in 120 s without a request)" in text
        assert "basal-4.5B   loading " in text and "/models/4.5B" in text
        assert "basal-max   failed " in text and "the weights need 62.1 GiB, the GPU has 24.0 GiB free" in text
        # between two polls the events tell: basal-4.5B loaded (it is not served until the next poll), the
        # served model starts unloading
        app.daemon_event({"kind": "model_loaded", "ts": NOW, "seq": 900, "model": "basal-4.5B", "load_s": 12.25})
        app.daemon_event({"kind": "model_unloading", "ts": NOW, "seq": 901, "model": "basal-demo"})
        await settle(pilot, app)
        text = screen_text(app)
        assert "basal-demo  (default)   unloading " in text and "basal-4.5B   loading " not in text
        header = text.splitlines()[0]
        assert " unloading basal-demo " in header and " ready " in header
    # at 80 columns the header keeps a model's state before the address
    data = DashboardData(clock=lambda: NOW, url="http://127.0.0.1:8000", connected=True)
    data.load_stats(run_time_models())
    assert " loading basal-4.5B " in status_text(data, width=80).plain
    data.load_stats(copy.deepcopy(STATS))  # a daemon without run-time models: nothing to say
    assert "loading" not in status_text(data, width=80).plain


async def test_requests_show_their_cached_tokens():
    app = make_app()
    async with app.run_test(size=(130, 32)) as pilot:
        await pilot.press("2")
        await settle(pilot, app)
        table = app.screen.query_one("#requests")
        column = [str(c.label) for c in table.columns.values()].index("cached")
        cells = {str(table.get_row_at(i)[0]): str(table.get_row_at(i)[column]) for i in range(table.row_count)}
        assert cells["req-0003"] == "157" and cells["req-0000"] == "57" and cells["req-0005"] == "-"


def test_graph_pool_meter_counts_the_segments_of_the_graphs_pool():
    from basal_local.backends.torch.graphs import pool_bytes

    snapshot = [{"total_size": 2 << 30, "segment_pool_id": (0, 0)},  # the allocator's default pool
                {"total_size": 300, "segment_pool_id": (0, 1)}, {"total_size": 50, "segment_pool_id": [0, 1]},
                {"total_size": 999, "segment_pool_id": (0, 2)}]  # another backend's graphs
    assert pool_bytes(snapshot, (0, 1)) == 350
    assert pool_bytes(snapshot, None) == 0  # no capture yet


async def test_two_gpus_fit_80x24():
    """Two replicas at 80x24: four lanes, a line per GPU, the cache and the totals, nothing pushed off screen."""
    app = make_app(two_replicas())
    async with app.run_test(size=(80, 24)) as pilot:
        await settle(pilot, app)
        text = screen_text(app)
        assert "GPU0 87 %  24.0/140.0 GiB  weights 8.5  graphs 1.5  cache 6.0  other 8.0" in text
        assert "GPU1 64 %  20.0/140.0 GiB  weights 8.5  graphs 1.5  cache 2.0  other 8.0" in text
        assert "main-r1" in text and "long-r1" in text
        # both replicas' caches in one line: 500 hits of 770 lookups, 8 of 24 GiB
        assert "cache hit 65 % 500/770  1.5M tok  8.0/24.0 GiB  48 nodes  9 evict" in text
        assert "recv 8  ok 5" in text and text.splitlines()[-1].startswith(" c clear stats")


def test_c_starts_the_cache_counters_over():
    """`c`: hits, misses, hit tokens and evictions count from the clear (memory, nodes and tokens are states)."""
    data = DashboardData(clock=lambda: NOW)
    data.load_stats(two_replicas())
    data.clear()
    later = two_replicas()
    model = later["models"][0]
    # replica 0: 10 hits, 3 misses, 1,000 tokens more; replica 1: 2, 3, 1,000; the model: both added up
    more = [(model["prefix_cache"], 12, 6, 2000), (model["replicas"][0]["prefix_cache"], 10, 3, 1000),
            (model["replicas"][1]["prefix_cache"], 2, 3, 1000)]
    for cache, hits, misses, tokens in more:
        cache.update(hits=cache["hits"] + hits, misses=cache["misses"] + misses, hit_tokens=cache["hit_tokens"] + tokens)
    data.load_stats(later)
    rows = dict(data.caches(per_replica=True))
    assert (rows["basal-demo/r0"]["hits"], rows["basal-demo/r0"]["misses"]) == (10, 3)
    assert (rows["basal-demo/r1"]["hits"], rows["basal-demo/r1"]["evictions"]) == (2, 0)
    assert rows["basal-demo/r0"]["bytes"] == 6 * GiB  # a state, not a counter
    assert cache_line(data).plain.startswith("state cache hit 67 % 12/18  2,000 tok saved  8.0/24.0 GiB")
    data.load_stats(copy.deepcopy(STATS))  # the daemon restarted with one replica: its own counters again
    assert dict(data.caches())["basal-demo"]["hits"] == 412


def test_a_cpu_daemon_shows_its_cache_pool_beside_the_weights():
    from rich.console import Console

    from basal_local.tui.widgets.device import device_renderable

    group = device_renderable({"type": "cpu", "cpus": 2, "cpu_percent": 50.0, "rss_bytes": 300 * 2**20},
                              {"weights_bytes": 3 * 2**20, "prefix_cache_bytes": 256 * 10**6})
    console = Console(width=100, record=True, file=__import__("io").StringIO())
    console.print(group)
    # --prefix-cache 256MB: 256,000,000 bytes = 244.1 MiB
    assert console.export_text().strip() == "cpu 50 % of 2 cores  RSS 300.0 MiB  weights 3.0 MiB  cache 244.1 MiB"


async def test_a_port_names_its_format_and_an_inherited_calibration():
    stats = copy.deepcopy(STATS)
    stats["models"][0]["port"] = {"format": "gguf-q8_0", "bits": 8, "calibration_file": "CALIBRATION.json",
                                  "calibration_inherited": True}
    app = make_app(stats)
    async with app.run_test(size=(100, 32)) as pilot:
        await pilot.press("4")
        await settle(pilot, app)
        text = screen_text(app)
        assert "format                   gguf-q8_0, 8-bit" in text
        assert "calibration file         CALIBRATION.json  (inherited: the port ships none of its own)" in text

"""The dashboard with the clock it really uses, and the daemon's device telemetry (telemetry/device.py): NVML and
MLX through fakes, the CPU for real, `/api/stats` and the event stream of a live daemon, rates that move."""

from __future__ import annotations

import asyncio
import json
import threading
import time
import types

import pytest

pytest.importorskip("textual")

from basal_local.telemetry import device as device_module  # noqa: E402
from basal_local.telemetry.device import DeviceMonitor  # noqa: E402
from basal_local.tui.app import DashboardApp  # noqa: E402

from .conftest import http  # noqa: E402
from .dashboard_canned import CannedSource, request_events, screen_text  # noqa: E402
from .test_events import M, SseReader, body, live  # noqa: E402, F401  (live: a fixture)


async def wait_until(pilot, predicate, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        await pilot.pause(0.05)
    return predicate()


async def test_rates_and_sparklines_move_with_the_real_clock():
    """No injected clock: events stamped with the real time, as a daemon stamps them, move the rates."""
    app = DashboardApp(CannedSource(events=[]), refresh_s=0.25)
    async with app.run_test(size=(80, 24)) as pilot:
        label = app.screen.query_one("#kpi-rps").query_one("Label")
        seen: list[float] = []
        start, n = time.time(), 0
        while time.time() - start < 3.2:  # ten requests a second for three seconds
            for event in request_events(f"rt-{n}", time.time(), "curl/8", n, 1):
                app.daemon_event(event)
            n += 1
            await pilot.pause(0.1)
            value = float(str(label.content))
            if not seen or value != seen[-1]:
                seen.append(value)
        nonzero = [v for v in seen if v > 0]
        assert len(nonzero) >= 2 and nonzero == sorted(nonzero), seen  # it rose, second by second
        spark = app.screen.query_one("#kpi-rps").query_one("Sparkline")
        assert sum(spark.data) >= 3  # the sparkline drew those seconds too


def test_cpu_sample_has_cpu_percent_and_rss():
    monitor = DeviceMonitor(max_age_s=0.0)
    first = monitor.sample()
    assert first["type"] == "cpu" and first["rss_bytes"] > 1 << 20 and "cpu_percent" not in first
    deadline = time.process_time() + 0.2
    while time.process_time() < deadline:  # spend CPU time, so the next sample has some to show
        pass
    second = monitor.sample()
    assert second["cpu_percent"] > 0 and second["cpus"] >= 1


class FakeNvml(types.ModuleType):
    NVML_CLOCK_SM = 1
    NVML_TEMPERATURE_GPU = 0

    def __init__(self) -> None:
        super().__init__("pynvml")
        self.inits = 0

    def nvmlInit(self):  # noqa: N802 (NVML's names)
        self.inits += 1

    def nvmlDeviceGetCount(self):  # noqa: N802
        return 1

    def nvmlDeviceGetHandleByIndex(self, i):  # noqa: N802
        return f"gpu{i}"

    def nvmlDeviceGetName(self, h):  # noqa: N802
        return b"NVIDIA H200"

    def nvmlDeviceGetUtilizationRates(self, h):  # noqa: N802
        return types.SimpleNamespace(gpu=87, memory=40)

    def nvmlDeviceGetMemoryInfo(self, h):  # noqa: N802
        return types.SimpleNamespace(used=24 << 30, total=140 << 30, free=116 << 30)

    def nvmlDeviceGetPowerUsage(self, h):  # noqa: N802
        return 412_345  # milliwatts

    def nvmlDeviceGetEnforcedPowerLimit(self, h):  # noqa: N802
        raise RuntimeError("NVML_ERROR_NOT_SUPPORTED")  # a field the driver does not report is left out

    def nvmlDeviceGetClockInfo(self, h, kind):  # noqa: N802
        return 1980 if kind == self.NVML_CLOCK_SM else 0

    def nvmlDeviceGetTemperature(self, h, kind):  # noqa: N802
        return 54


def test_nvml_sample_when_cuda_is_in_use(monkeypatch):
    fake = FakeNvml()
    monkeypatch.setitem(__import__("sys").modules, "pynvml", fake)
    monkeypatch.setattr(device_module, "_cuda_in_use", lambda: True)
    monitor = DeviceMonitor(max_age_s=0.0)
    sample = monitor.sample()
    assert sample["type"] == "nvidia"
    assert sample["gpus"] == [{"index": 0, "name": "NVIDIA H200", "util_percent": 87,
                               "memory_used_bytes": 24 << 30, "memory_total_bytes": 140 << 30,
                               "memory_free_bytes": 116 << 30, "power_w": 412.3, "clock_mhz": 1980,
                               "temperature_c": 54}]
    monitor.sample()
    assert fake.inits == 1  # NVML opened once
    monkeypatch.setattr(device_module, "_cuda_in_use", lambda: False)
    assert "gpus" not in monitor.sample()  # a CPU daemon does not report the machine's GPUs


def test_nvml_for_a_daemon_whose_cuda_runs_in_worker_processes(monkeypatch):
    """Replicas on several GPUs compute in worker processes: the daemon's own process never initializes CUDA, so
    the daemon's word (`cuda`, set from its device) turns the GPUs' telemetry on."""
    monkeypatch.setitem(__import__("sys").modules, "pynvml", FakeNvml())
    monkeypatch.setattr(device_module, "_cuda_in_use", lambda: False)
    monitor = DeviceMonitor(max_age_s=0.0)
    assert "gpus" not in monitor.sample()
    monitor.cuda = True
    assert monitor.sample()["gpus"][0]["name"] == "NVIDIA H200"


def test_no_nvml_falls_back_to_the_cpu(monkeypatch):
    monkeypatch.setitem(__import__("sys").modules, "pynvml", None)  # import fails: not installed
    monkeypatch.setattr(device_module, "_cuda_in_use", lambda: True)
    sample = DeviceMonitor(max_age_s=0.0).sample()
    assert sample["type"] == "cpu" and "rss_bytes" in sample


def test_mlx_memory_counters(monkeypatch):
    mx = types.SimpleNamespace(get_active_memory=lambda: 3 << 30, get_cache_memory=lambda: 1 << 30,
                               get_peak_memory=lambda: 5 << 30,
                               metal=types.SimpleNamespace(is_available=lambda: True))
    monkeypatch.setitem(__import__("sys").modules, "mlx.core", mx)
    monkeypatch.setattr(device_module, "_cuda_in_use", lambda: False)
    sample = DeviceMonitor(max_age_s=0.0).sample()
    assert sample["type"] == "mlx"
    assert sample["mlx"] == {"active_bytes": 3 << 30, "cache_bytes": 1 << 30, "peak_bytes": 5 << 30}
    mx.metal.is_available = lambda: False  # MLX on the CPU: nothing but the process's figures
    assert DeviceMonitor(max_age_s=0.0).sample()["type"] == "cpu"


@pytest.fixture(scope="module")
def daemon(request):
    """test_events' live daemon (an app and its engine in a thread behind a real socket), one for this module."""
    return request.getfixturevalue("live")


def test_device_telemetry_in_stats_and_on_the_event_stream(daemon):
    status, _, stats = http("GET", daemon.url + "/api/stats")
    assert status == 200 and stats["device"] == "cpu"  # the backend's device keeps its key
    # each model's replicas with their device and the backend's memory figures (the dashboard splits each GPU
    # by the replicas on it)
    [replica] = stats["models"][0]["replicas"]
    assert replica["replica"] == 0 and replica["device"] == "cpu" and replica["alive"] is True
    assert replica["memory"]["weights_bytes"] > 0
    assert daemon.state.telemetry.device.cuda is False
    telemetry = stats["device_telemetry"]
    assert telemetry["type"] == "cpu" and telemetry["rss_bytes"] > 1 << 20
    reader = SseReader(daemon.port)
    try:
        events = reader.wait_for(lambda ev: any(e["kind"] == "device" for e in ev), timeout=10)
    finally:
        reader.close()
    sample = next(e for e in events if e["kind"] == "device")
    assert sample["type"] == "cpu" and sample["rss_bytes"] > 1 << 20 and "cpu_percent" in sample


async def test_dashboard_on_a_live_daemon_with_the_real_clock(daemon):
    """The planted bug of issue 30 (every rate 0 under the real clock) fails here: real client, real clock."""
    from basal_local.tui.client import DaemonClient

    daemon.state.telemetry.emit("log", level="INFO", logger="basal_local.daemon", message="backlog line before attach")
    client = DaemonClient(daemon.url, stats_every_s=0.2, retry_s=0.2)
    app = DashboardApp(client, refresh_s=0.25)
    stop = threading.Event()

    def traffic() -> None:
        i = 0
        while not stop.is_set() and i < 400:  # bounded
            http("POST", daemon.url + "/v1/systemone", body(i, 1))
            i += 1

    async with app.run_test(size=(120, 40)) as pilot:
        assert await wait_until(pilot, lambda: app.data.connected)
        thread = threading.Thread(target=traffic, daemon=True)
        thread.start()
        try:
            label = app.screen.query_one("#kpi-rps").query_one("Label")
            assert await wait_until(pilot, lambda: float(str(label.content)) > 0, timeout=15)
            assert await wait_until(pilot, lambda: app.data.device.get("rss_bytes", 0) > 0)
            assert "RSS" in screen_text(app) and "cpu" in screen_text(app)
        finally:
            stop.set()
            await asyncio.get_running_loop().run_in_executor(None, thread.join, 30)
        await pilot.press("5")
        await pilot.pause(0.3)
        assert "backlog line before attach" in screen_text(app)


def test_demo_traffic_shows_sharing_a_long_document_and_a_large_choice(daemon):
    """--demo-traffic's bodies are valid, and its bursts batch together: one state, many question branches."""
    import random

    from basal_local.server import demotraffic

    rng = random.Random(7)
    from basal_local.bench import sample_requests

    item = next(s for s in sample_requests() if s["id"] == "en-008")
    corpus = demotraffic._corpus()  # noqa: SLF001
    long_body = demotraffic.long_document(corpus, random.Random(1), M)
    status, _, answer = http("POST", daemon.url + "/v1/systemone", long_body)
    assert status == 200, answer
    assert len(long_body["state"]) >= demotraffic.LONG_CHARS[0]
    status, _, answer = http("POST", daemon.url + "/v1/systemone", demotraffic.large_choice(item, M))
    assert status == 200 and answer["answers"]["topic"]["choice"] in demotraffic.TOPICS["en"], answer
    bodies = demotraffic.burst(item, rng, M)
    assert len({json.dumps(b["state"]) for b in bodies}) == 1 and len(bodies) >= demotraffic.BURST[0]
    stop = threading.Event()
    before = daemon.state.telemetry.counters["batches"]
    threads = demotraffic.demo_traffic(daemon.url, stop, clients=3, pause_s=0.05)
    deadline = time.time() + 60
    try:
        while time.time() < deadline and daemon.state.telemetry.counters["batches"] - before < 12:
            time.sleep(0.1)
    finally:
        stop.set()
        for thread in threads:
            thread.join(timeout=60)
    batches = list(daemon.state.telemetry.batches)[-(daemon.state.telemetry.counters["batches"] - before):]
    assert len(batches) >= 12
    assert max(b.requests for b in batches) >= 3  # a burst landed in one batch
    assert sum(b.requests for b in batches) / len(batches) > 1.5
    assert any(b.unpacked_tokens >= 2 * b.packed_tokens for b in batches)  # the tree saved half the tokens

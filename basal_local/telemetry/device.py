"""Device telemetry for `/api/stats` (`device_telemetry`) and the event stream (`device` events): GPU utilization, memory, power and clock.

NVIDIA through NVML (`nvidia-ml-py`, an optional dependency, imported only when CUDA is in use); Apple through
MLX's memory counters when MLX is loaded; otherwise (and always beside them) this process's CPU % and RSS.
A sample is cached for `max_age_s`, so a dashboard polling once a second costs one NVML query per second.
`DeviceMonitor.follow(bus)` emits a `device` event each second while someone reads the event stream.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from typing import Any

log = logging.getLogger(__name__)

MAX_GPUS = 8
TICK_S = 1.0
IDLE_STOP_S = 10.0  # the ticker stops after this long without a reader (the next snapshot starts it again)


def process_rss() -> int | None:
    try:
        with open("/proc/self/statm") as fh:
            return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        try:
            import resource

            peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # the peak is all macOS offers cheaply
            return peak if sys.platform == "darwin" else peak * 1024
        except Exception:
            return None


def _cuda_in_use() -> bool:
    # a CPU daemon on an NVIDIA machine must not report the GPUs it does not use
    torch = sys.modules.get("torch")
    try:
        return bool(torch is not None and torch.cuda.is_initialized())
    except Exception:
        return False


class _Nvml:
    """NVML handles, opened once; any failure turns NVIDIA telemetry off with one log line."""

    def __init__(self) -> None:
        import pynvml  # nvidia-ml-py

        self.nvml = pynvml
        pynvml.nvmlInit()
        count = pynvml.nvmlDeviceGetCount()
        self.handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(min(count, MAX_GPUS))]

    def sample(self) -> list[dict[str, Any]]:
        nv = self.nvml
        out = []
        for index, handle in enumerate(self.handles):
            gpu: dict[str, Any] = {"index": index}
            readers = {
                "name": lambda h: _text(nv.nvmlDeviceGetName(h)),
                "util_percent": lambda h: nv.nvmlDeviceGetUtilizationRates(h).gpu,
                "memory": lambda h: nv.nvmlDeviceGetMemoryInfo(h),
                "power_w": lambda h: round(nv.nvmlDeviceGetPowerUsage(h) / 1000.0, 1),
                "power_limit_w": lambda h: round(nv.nvmlDeviceGetEnforcedPowerLimit(h) / 1000.0, 1),
                "clock_mhz": lambda h: nv.nvmlDeviceGetClockInfo(h, nv.NVML_CLOCK_SM),
                "temperature_c": lambda h: nv.nvmlDeviceGetTemperature(h, nv.NVML_TEMPERATURE_GPU),
            }
            for key, read in readers.items():
                try:
                    value = read(handle)
                except Exception:  # a field this GPU or driver does not report
                    continue
                if key == "memory":
                    gpu.update(memory_used_bytes=int(value.used), memory_total_bytes=int(value.total),
                               memory_free_bytes=int(value.free))
                else:
                    gpu[key] = value
            out.append(gpu)
        return out


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _mlx_memory() -> dict[str, int] | None:
    mx = sys.modules.get("mlx.core")  # only when the daemon already runs MLX: never import it for telemetry
    if mx is None:
        return None
    try:
        if not mx.metal.is_available():  # MLX on the CPU (Linux, the tests' twin): no device memory to show
            return None
        return {"active_bytes": int(mx.get_active_memory()), "cache_bytes": int(mx.get_cache_memory()),
                "peak_bytes": int(mx.get_peak_memory())}
    except Exception:
        return None


class DeviceMonitor:
    """Samples the device and this process; `sample()` is cheap to call often (cached)."""

    def __init__(self, max_age_s: float = 0.5) -> None:
        self.max_age_s = max_age_s
        self._lock = threading.Lock()
        self._nvml: _Nvml | None = None
        self._nvml_tried = False
        self._cpu_at: tuple[float, float] | None = None  # (monotonic, process cpu seconds) of the last sample
        self._last: dict[str, Any] = {}
        self._last_at = -1e9
        self._ticker: threading.Thread | None = None
        self._read_at = time.monotonic()
        # the daemon computes on CUDA in worker processes (replicas on several GPUs): this process never
        # initializes CUDA itself, so the daemon says so (server/events.py) for NVML to report the GPUs
        self.cuda = False

    def _gpus(self) -> list[dict[str, Any]] | None:
        if not (self.cuda or _cuda_in_use()):
            return None
        if not self._nvml_tried:
            self._nvml_tried = True
            try:
                self._nvml = _Nvml()
            except Exception as exc:  # not installed, no driver, no permission
                log.info("no NVIDIA telemetry (%s: %s); install basal-local[nvidia] for it", type(exc).__name__, exc)
        if self._nvml is None:
            return None
        try:
            return self._nvml.sample()
        except Exception:
            return None

    def sample(self) -> dict[str, Any]:
        with self._lock:
            now = time.monotonic()
            if now - self._last_at < self.max_age_s:
                return dict(self._last)
            times = os.times()
            cpu_s = times.user + times.system
            out: dict[str, Any] = {"type": "cpu", "cpus": os.cpu_count() or 1}
            if self._cpu_at is not None and now > self._cpu_at[0]:
                out["cpu_percent"] = round(100.0 * (cpu_s - self._cpu_at[1]) / (now - self._cpu_at[0]), 1)
            self._cpu_at = (now, cpu_s)
            rss = process_rss()
            if rss is not None:
                out["rss_bytes"] = rss
            gpus = self._gpus()
            if gpus:
                out.update(type="nvidia", gpus=gpus)
            else:
                mlx = _mlx_memory()
                if mlx is not None:
                    out.update(type="mlx", mlx=mlx)
            self._last, self._last_at = out, now
            return dict(out)

    def follow(self, bus: Any) -> None:
        """Emit `device` events on `bus` each second while it has subscribers; idempotent."""
        with self._lock:
            self._read_at = time.monotonic()
            if self._ticker is not None and self._ticker.is_alive():
                return
            self._ticker = threading.Thread(target=self._tick, args=(bus,), name="basal-device-telemetry",
                                            daemon=True)
            self._ticker.start()

    def _tick(self, bus: Any) -> None:
        while True:
            time.sleep(TICK_S)
            if bus.subscribers:
                self._read_at = time.monotonic()
                try:
                    bus.emit("device", **self.sample())
                except Exception:  # telemetry must never take a thread down with a traceback loop
                    log.exception("device telemetry stopped")
                    return
            elif time.monotonic() - self._read_at > IDLE_STOP_S:
                return

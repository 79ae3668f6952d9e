"""The device pane: GPU utilization, memory (weights, graphs, cache, free), power and clock, or CPU and RSS.

From the daemon's `device` sample (basal_local/telemetry/device.py, in `/api/stats` and each second on the event
stream) and its `memory` figures (the backend's own count of weights and cache).
"""

from __future__ import annotations

from typing import Any

from rich.bar import Bar
from rich.console import Group
from rich.table import Table
from rich.text import Text

from .format import size

# the backend's memory figures that split a GPU's used memory, in the order shown
PARTS = [("weights", "weights_bytes"), ("graphs", "graphs_bytes"), ("cache", "state_cache_bytes")]


def _gib(n: float) -> str:
    return f"{n / 2**30:.1f}"


def gpu_lines(gpu: dict[str, Any], memory: dict[str, Any], narrow: bool) -> list[Text | Table]:
    head = Text()
    head.append(f"GPU{gpu.get('index', 0)} ", style="bold")
    if not narrow and gpu.get("name"):
        head.append(f"{gpu['name']}  ")
    if "util_percent" in gpu:
        util = float(gpu["util_percent"])
        head.append(f"util {util:.0f} %", style="bold green" if util >= 50 else "bold")
    if "power_w" in gpu:
        limit = f"/{gpu['power_limit_w']:.0f}" if gpu.get("power_limit_w") else ""
        head.append(f"  {gpu['power_w']:.0f}{limit} W")
    if "clock_mhz" in gpu:
        head.append(f"  {gpu['clock_mhz']} MHz")
    if "temperature_c" in gpu and not narrow:
        head.append(f"  {gpu['temperature_c']} \u00b0C")
    out: list[Text | Table] = [head]
    total, used = gpu.get("memory_total_bytes"), gpu.get("memory_used_bytes")
    if total and used is not None:
        row = Table.grid(padding=(0, 1))
        row.add_row(Text("mem"), Bar(float(total), 0.0, float(used), width=10 if narrow else 20, color="cyan",
                                     bgcolor="grey23"), Text(f"{_gib(used)}/{_gib(total)} GiB"))
        out.append(row)
        split = [f"{name} {size(memory[key])}" for name, key in PARTS if memory.get(key)]
        split.append(f"free {size(gpu.get('memory_free_bytes', total - used))}")
        out.append(Text("  ".join(split), style="dim"))
    return out


def device_renderable(device: dict[str, Any], memory: dict[str, Any], narrow: bool = False) -> Group:
    """What the device does now; `-` where the daemon sent nothing yet (an older daemon)."""
    lines: list[Text | Table] = []
    for gpu in device.get("gpus") or []:
        lines += gpu_lines(gpu, memory, narrow)
    mlx = device.get("mlx")
    if mlx:
        lines.append(Text(f"Metal active {size(mlx.get('active_bytes'))}  cache {size(mlx.get('cache_bytes'))}  "
                          f"peak {size(mlx.get('peak_bytes'))}"))
    cpu = Text()
    if "cpu_percent" in device:
        cpu.append("cpu ", style="bold")
        cpu.append(f"{device['cpu_percent']:.0f} %")
        cpu.append(f" of {device.get('cpus', '?')} cores", style="dim")
    rss = device.get("rss_bytes", memory.get("host_rss_bytes"))
    if rss is not None:
        cpu.append(("  " if cpu else "") + f"RSS {size(rss)}")
    if not device.get("gpus"):
        if memory.get("weights_bytes"):
            cpu.append(f"  weights {size(memory['weights_bytes'])}")
        if memory.get("device_allocated_bytes"):
            cpu.append(f"  device {size(memory['device_allocated_bytes'])}")
    lines.append(cpu if cpu else Text("no device figures yet", style="dim"))
    return Group(*lines)

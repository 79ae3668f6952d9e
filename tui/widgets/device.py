"""The device pane: GPU utilization, memory (weights, graphs, cache, other, free), power and clock, or CPU and RSS.

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

# the backend's memory figures that split a GPU's used memory, in the order shown; "other" is what NVML counts
# beyond them (the CUDA context, the allocator's cache, activations, other processes)
PARTS = [("weights", "weights_bytes", "cyan"), ("graphs", "graphs_bytes", "blue"),
         ("cache", "prefix_cache_bytes", "magenta")]


def _gib(n: float) -> str:
    return f"{n / 2**30:.1f}"


def gpu_memory(index: int, memory: dict[str, Any], replicas: list[dict[str, Any]], gpus: int) -> dict[str, Any]:
    """The backend figures of the replicas (of every model) on GPU `index` added up; the daemon's one figure
    where no replica names the device (an older daemon) and there is one GPU."""
    here = [r["memory"] for r in replicas if r.get("memory")
            and str(r.get("device", "")) in (f"cuda:{index}",) + (("cuda",) if index == 0 else ())]
    if not here:
        return memory if gpus == 1 else {}
    return {key: sum(int(m.get(key, 0) or 0) for m in here) for _, key, _ in PARTS}


def memory_split(gpu: dict[str, Any], memory: dict[str, Any]) -> list[tuple[str, int, str]]:
    """(part, bytes, colour) of a GPU's memory: weights, graphs, cache, other, free (only the parts reported)."""
    total, used = gpu.get("memory_total_bytes"), gpu.get("memory_used_bytes")
    parts = [(name, int(memory[key]), colour) for name, key, colour in PARTS if memory.get(key)]
    if used is not None and parts:
        other = int(used) - sum(n for _, n, _ in parts)
        if other > 0:
            parts.append(("other", other, "grey62"))
    if total and used is not None:
        parts.append(("free", int(gpu.get("memory_free_bytes", total - used)), "green"))
    return parts


def gpu_lines(gpu: dict[str, Any], memory: dict[str, Any], narrow: bool, tall: bool = False) -> list[Text | Table]:
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
        split = memory_split(gpu, memory)
        if tall and len(split) > 1:
            # one bar per part, each starting where the one before ended: the parts side by side along the GPU
            grid = Table.grid(padding=(0, 1))
            start = 0.0
            for name, n, colour in split:
                grid.add_row(Text(f"{name:<7}", style=colour),
                             Bar(float(total), start, start + n, width=20, color=colour, bgcolor="grey23"),
                             Text(f"{_gib(n):>5} GiB"))
                start += n
            out.append(grid)
        else:
            text = Text()
            for name, n, colour in split:
                text.append(("  " if text else "") + f"{name} ", style=colour)
                text.append(_gib(n) if narrow else size(n))
            if narrow:
                text.append(" GiB", style="dim")
            out.append(text)
    return out


def gpu_line(gpu: dict[str, Any], memory: dict[str, Any]) -> Text:
    """A GPU in one line (several GPUs on a short terminal): `GPU1 64 %  20.0/140.0 GiB  weights 8.5  graphs 1.5
    cache 2.0  other 8.0` (GiB; what is left of the total is free)."""
    text = Text(f"GPU{gpu.get('index', 0)} ", style="bold")
    if "util_percent" in gpu:
        util = float(gpu["util_percent"])
        text.append(f"{util:.0f} %", style="bold green" if util >= 50 else "bold")
    total, used = gpu.get("memory_total_bytes"), gpu.get("memory_used_bytes")
    if total and used is not None:
        text.append(f"  {_gib(used)}/{_gib(total)} GiB")
        for name, n, colour in memory_split(gpu, memory):
            if name != "free":
                text.append(f"  {name} ", style=colour).append(_gib(n))
    return text


def device_renderable(device: dict[str, Any], memory: dict[str, Any], narrow: bool = False,
                      replicas: list[dict[str, Any]] | None = None, tall: bool = False,
                      compact: bool = False) -> Group:
    """What the device does now; `-` where the daemon sent nothing yet (an older daemon). `replicas` (each with
    its device and memory figures) split each GPU's memory by what its own replicas hold; `tall`: a bar per part
    of it; `compact`: one line per GPU."""
    lines: list[Text | Table] = []
    gpus = device.get("gpus") or []
    for gpu in gpus:
        part = gpu_memory(int(gpu.get("index", 0)), memory, replicas or [], len(gpus))
        lines += [gpu_line(gpu, part)] if compact else gpu_lines(gpu, part, narrow, tall)
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
        if memory.get("prefix_cache_bytes"):  # the state cache's pool, reserved whole
            cpu.append(f"  cache {size(memory['prefix_cache_bytes'])}")
        if memory.get("device_allocated_bytes"):
            cpu.append(f"  device {size(memory['device_allocated_bytes'])}")
    lines.append(cpu if cpu else Text("no device figures yet", style="dim"))
    return Group(*lines)

"""Text helpers shared by the views: durations, sizes, bars (rich renderables, no hand-drawn bars)."""

from __future__ import annotations

import time

from rich.bar import Bar
from rich.table import Table
from rich.text import Text


def ms(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value:.0f}" if value >= 10 else f"{value:.1f}"


def duration(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    seconds = int(seconds)
    days, rest = divmod(seconds, 86400)
    hours, rest = divmod(rest, 3600)
    minutes, secs = divmod(rest, 60)
    if days:
        return f"{days}d{hours:02d}h"
    if hours:
        return f"{hours}h{minutes:02d}m"
    return f"{minutes}m{secs:02d}s"


def size(n: float | None) -> str:
    if n is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return "-"


def size_pair(used: float | None, total: float | None) -> str:
    """`6.0/12.0 GiB`: a part of a whole in the whole's unit."""
    if used is None or not total:
        return size(used)
    unit, scale = next(((u, 1024.0 ** k) for k, u in enumerate(("B", "KiB", "MiB", "GiB", "TiB"))
                        if total < 1024.0 ** (k + 1) or u == "TiB"))
    if unit == "B":
        return f"{used:.0f}/{total:.0f} B"
    return f"{used / scale:.1f}/{total / scale:.1f} {unit}"


def count(n: float | None) -> str:
    """A count in at most 6 cells: 9,999, then 48.2k, 1.2M, 3.4G."""
    if n is None:
        return "-"
    n = float(n)
    if abs(n) < 10_000:
        return f"{n:,.0f}"
    for unit, scale in (("k", 1e3), ("M", 1e6), ("G", 1e9)):
        if abs(n) < 999.5 * scale or unit == "G":
            return f"{n / scale:.1f}{unit}" if abs(n) < 99.95 * scale else f"{n / scale:.0f}{unit}"
    return "-"


def clock(ts: float | None) -> str:
    if not ts:
        return "-"
    return time.strftime("%H:%M:%S", time.localtime(ts))


def short_id(request_id: str, width: int = 10) -> str:
    return request_id if len(request_id) <= width else request_id[: width - 1] + "\u2026"


def probability_bar(p: float, width: int = 20) -> Bar:
    """A bar of `width` cells filled to p (0..1)."""
    return Bar(1.0, 0.0, max(0.0, min(1.0, p)), width=width, color="green", bgcolor="grey23")


def saving_line(packed: int, unpacked: int, width: int = 30) -> Table:
    """`packed [bar] unpacked  NN % saved`: the packed share of the unpacked tokens as a bar."""
    grid = Table.grid(padding=(0, 1))
    share = packed / unpacked if unpacked else 1.0
    grid.add_row(Text(f"{packed:,} packed"), Bar(1.0, 0.0, share, width=width, color="cyan", bgcolor="grey23"),
                 Text(f"{unpacked:,} unpacked"), Text(f"{100 * (1 - share):.0f} % saved", style="bold"))
    return grid

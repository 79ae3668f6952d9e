"""The state cache pane: hits and hit rate (all time and the last seconds), the tokens the hits saved, memory
against the budget, nodes, evictions; per model, or per replica where a model has several (each has its own).

From `/api/stats` `models[i]["prefix_cache"]` and the replicas' `prefix_cache`; one line under 36 terminal lines,
a table above.
"""

from __future__ import annotations

from typing import Any

from rich.bar import Bar
from rich.table import Table
from rich.text import Text

from ..data import DashboardData
from .format import count, size, size_pair

# (column, label, priority): under the pane's width the lowest priorities go first
# (the setting, one for the daemon, is in the pane's border)
COLUMNS = [("name", "model", 10), ("memory", "memory / budget", 8), ("nodes", "nodes", 4), ("tokens", "tokens", 3),
           ("hits", "hits", 7), ("misses", "misses", 5), ("rate", "hit rate", 9), ("recent", "10 s", 6),
           ("hit_tokens", "hit tok", 8), ("evictions", "evicted", 6)]
WIDTH = {"name": 14, "memory": 23, "nodes": 6, "tokens": 6, "hits": 6, "misses": 6, "rate": 8, "recent": 5,
         "hit_tokens": 7, "evictions": 7}
BAR = 10  # cells of the memory bar


def hit_rate(cache: dict[str, Any]) -> float | None:
    lookups = int(cache.get("hits", 0) or 0) + int(cache.get("misses", 0) or 0)
    return int(cache.get("hits", 0) or 0) / lookups if lookups else None


def percent(share: float | None) -> str:
    return "-" if share is None else f"{100 * share:.0f} %"


def memory_text(cache: dict[str, Any]) -> str:
    used, budget = cache.get("bytes"), cache.get("budget_bytes")
    return size_pair(used, budget) if budget else size(used)


def memory_bar(cache: dict[str, Any], width: int = BAR) -> Bar:
    budget = float(cache.get("budget_bytes") or 0)
    used = float(cache.get("bytes") or 0)
    full = budget and used >= 0.95 * budget  # at the budget: new states evict old ones
    return Bar(budget or 1.0, 0.0, min(used, budget) if budget else 0.0, width=width,
               color="yellow" if full else "magenta", bgcolor="grey23")


def _setting_note(cache: dict[str, Any]) -> str:
    """Why a cache is off when its setting is not "off" (e.g. "auto" on a device that leaves it no room)."""
    setting = str(cache.get("setting") or "off")
    return "" if setting == "off" else f" (setting {setting})"


def cache_line(data: DashboardData, narrow: bool = False) -> Text:
    """Every model's cache in one line: `state cache hit 73 % 412/562 now 80 %  1.2M tok saved  6.0/12.0 GiB
    37 nodes  9 evicted` ("now": the last 10 s of stats polls; hit tokens: continued, not computed)."""
    caches = data.caches()
    text = Text()
    text.append("cache " if narrow else "state cache ", style="bold")
    if not caches:
        return text.append("not reported by this daemon", style="dim")
    total = data.cache_total()
    if not total["enabled"]:
        return text.append("off", style="bold").append(_setting_note(total), style="dim")
    hits, misses = int(total["hits"]), int(total["misses"])
    text.append("hit ", style="dim")
    text.append(percent(hit_rate(total)), style="bold green" if (hit_rate(total) or 0) >= 0.5 else "bold")
    text.append(f" {count(hits)}/{count(hits + misses)}", style="dim")
    recent = data.recent_hit_rate("")
    if recent is not None:
        text.append(f" now {percent(recent)}", style="dim")
    text.append(f"  {count(total['hit_tokens'])} tok", style="")
    text.append(" saved" if not narrow else "", style="dim")
    text.append(f"  {memory_text(total)}")
    text.append(f"  {count(total['nodes'])} nodes", style="")
    text.append(f"  {count(total['evictions'])} evict" + ("" if narrow else "ed"),
                style="yellow" if total["evictions"] else "")
    return text


def _cells(data: DashboardData, label: str, cache: dict[str, Any]) -> dict[str, Any]:
    if not cache.get("enabled"):
        return {"name": label, "memory": Text("off" + _setting_note(cache), style="dim")}
    memory = Table.grid(padding=(0, 1))
    memory.add_row(memory_bar(cache), Text(memory_text(cache)))
    rate = hit_rate(cache)
    return {"name": label, "memory": memory,
            "nodes": count(cache.get("nodes")), "tokens": count(cache.get("tokens")),
            "hits": count(cache.get("hits")), "misses": count(cache.get("misses")),
            "rate": Text(percent(rate), style="bold green" if (rate or 0) >= 0.5 else "bold"),
            "recent": percent(data.recent_hit_rate(label)), "hit_tokens": count(cache.get("hit_tokens")),
            "evictions": Text(count(cache.get("evictions")), style="yellow" if cache.get("evictions") else "")}


def columns_for(width: int) -> list[tuple[str, str]]:
    kept = list(COLUMNS)
    while sum(max(WIDTH[c], len(label)) + 2 for c, label, _ in kept) > width and len(kept) > 3:
        kept.remove(min(kept, key=lambda c: c[2]))
    return [(c, label) for c, label, _ in kept]


def cache_table(data: DashboardData, width: int = 120) -> Table | Text:
    """One row per model, or per replica where a model has several; columns by priority for the width."""
    caches = data.caches(per_replica=True)
    if not caches:
        return Text("this daemon reports no state cache", style="dim")
    columns = columns_for(width)
    table = Table(expand=width < 150, box=None, header_style="bold", pad_edge=False)  # no gaps on big screens
    for key, label in columns:
        table.add_column(label, justify="left" if key in ("name", "memory") else "right", no_wrap=True,
                         overflow="ellipsis", max_width=WIDTH["name"] if key == "name" else None)
    for label, cache in caches:
        cells = _cells(data, label, cache)
        table.add_row(*(cells.get(key, "-") for key, _ in columns))
    return table

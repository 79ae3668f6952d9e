"""View 1: KPIs with sparklines, the queue per model and lane, device memory."""

from __future__ import annotations

from rich.table import Table
from rich.text import Text
from textual.app import ComposeResult
from textual.containers import Grid
from textual.widgets import Static

from ..data import DashboardData
from ..widgets.format import ms, size
from ..widgets.kpi import KpiCard
from .base import DashboardScreen

KPIS = [("rps", "requests/s"), ("dps", "decisions/s"), ("tps", "tokens/s"), ("inflight", "in flight"),
        ("queue", "queue p50/p95"), ("compute", "compute p50/95"), ("errors", "errors"),
        ("overloaded", "529 overloaded")]


def queue_table(data: DashboardData) -> Table:
    table = Table(expand=True, box=None, header_style="bold", pad_edge=False)
    for name in ("model", "lane", "waiting", "tokens", "oldest wait", "running"):
        table.add_column(name, justify="left" if name in ("model", "lane", "running") else "right")
    queues = data.stats.get("queues", {})
    if not queues:
        table.add_row("-", "-", "-", "-", "-", "-")
    for model, lanes in queues.items():
        for lane, q in lanes.items():
            running = q.get("running") or data.running.get(f"{model}/{lane}")
            members = (running.get("request_ids") or running.get("requests")) if running else None
            count = len(members) if isinstance(members, list) else members
            busy = f"batch {running.get('batch_id')}: {count} req" if running else "idle"
            wait = q.get("oldest_wait_ms", 0.0)
            table.add_row(model, lane, str(q.get("waiting", 0)), f"{q.get('waiting_tokens', 0):,}",
                          Text(f"{ms(wait)} ms", style="red" if wait > 1000 else ""), busy)
    return table


def memory_text(data: DashboardData) -> Text:
    mem = data.stats.get("memory", {})
    parts = []
    if "device_allocated_bytes" in mem:
        parts.append(f"device {size(mem['device_allocated_bytes'])} allocated, peak {size(mem.get('device_peak_bytes'))}")
    if "weights_bytes" in mem:
        parts.append(f"weights {size(mem['weights_bytes'])}")
    if "host_rss_bytes" in mem:
        parts.append(f"host RSS {size(mem['host_rss_bytes'])}")
    return Text("  ".join(parts) or "no memory figures yet")


class OverviewScreen(DashboardScreen):
    KEYS = [("c", "clear stats")]  # the app's key; shown where counters and sparklines are
    DEFAULT_CSS = """
    OverviewScreen #kpis { grid-size: 4; grid-gutter: 0 1; height: 8; }
    OverviewScreen .panel { border: round $primary-darken-2; height: auto; padding: 0 1; }
    """

    def body(self) -> ComposeResult:
        with Grid(id="kpis"):
            for key, title in KPIS:
                yield KpiCard(title, id=f"kpi-{key}")
        queue = Static(id="queues", classes="panel")
        queue.border_title = "queue per model and lane"
        yield queue
        memory = Static(id="memory", classes="panel")
        memory.border_title = "memory"
        yield memory

    def refresh_data(self, data: DashboardData) -> None:
        totals = data.stats.get("totals", {})
        limits = data.stats.get("limits", {})

        def card(key: str) -> KpiCard:
            return self.query_one(f"#kpi-{key}", KpiCard)

        card("rps").show(f"{data.rate('requests'):.1f}", data.series("requests"))
        card("dps").show(f"{data.rate('decisions'):.1f}", data.series("decisions"))
        card("tps").show(f"{data.rate('tokens'):,.0f}", data.series("tokens"))
        inflight = data.stats.get("inflight", totals.get("in_flight", 0))
        limit = limits.get("max_inflight")
        card("inflight").show(f"{inflight} / {limit or '-'}", alert=bool(limit and inflight >= 0.8 * limit))
        card("queue").show(f"{ms(data.latency(0, 50))} / {ms(data.latency(0, 95))} ms", data.series("queue_ms"))
        card("compute").show(f"{ms(data.latency(1, 50))} / {ms(data.latency(1, 95))} ms", data.series("compute_ms"))
        errors = data.total("failed")  # since `c` cleared the stats, if it did
        card("errors").show(f"{errors} (+{data.total('rejected')} 4xx)", data.series("errors"), alert=errors > 0)
        overloaded = data.total("overloaded")
        card("overloaded").show(str(overloaded), data.series("overloaded"), alert=overloaded > 0)
        self.query_one("#queues", Static).update(queue_table(data))
        self.query_one("#memory", Static).update(memory_text(data))

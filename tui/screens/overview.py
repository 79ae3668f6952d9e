"""View 1: KPIs with sparklines, the queue per model and lane beside the device, the state cache, the totals.

The KPI cards take the height the terminal leaves (their sparklines grow); from 160 columns the queue and the
device sit side by side; under 100 columns titles shorten; under 36 lines the state cache and the totals take
one line each.
"""

from __future__ import annotations

from rich.bar import Bar
from rich.console import Group
from rich.table import Table
from rich.text import Text
from textual.app import ComposeResult
from textual.containers import Grid, Horizontal
from textual.widgets import Static

from ..data import DashboardData
from ..widgets.cache import cache_line, cache_table
from ..widgets.device import device_renderable
from ..widgets.format import ms
from ..widgets.kpi import KpiCard
from .base import DashboardScreen

# (key, title, title under 100 columns)
KPIS = [("rps", "requests/s", "requests/s"), ("dps", "decisions/s", "decisions/s"), ("tps", "tokens/s", "tokens/s"),
        ("inflight", "in flight", "in flight"), ("queue", "queue p50/p95", "queue 50/95"),
        ("compute", "compute p50/p95", "compute 50/95"), ("errors", "errors", "errors"),
        ("overloaded", "529 overloaded", "529 overload")]
TOTALS = [("received", "received"), ("answered", "answered"), ("failed", "failed"), ("rejected", "rejected"),
          ("overloaded", "529"), ("cancelled", "cancelled")]
SHORT_TOTALS = {"received": "recv", "answered": "ok", "failed": "failed", "rejected": "4xx", "overloaded": "529",
                "cancelled": "cancel"}


def queue_table(data: DashboardData, narrow: bool = False) -> Table:
    table = Table(expand=True, box=None, header_style="bold", pad_edge=False)
    names = ("model", "lane", "wait", "tok", "oldest", "running") if narrow else (
        "model", "lane", "waiting", "tokens", "oldest wait", "running")
    for n, name in enumerate(names):
        table.add_column(name, justify="left" if n in (0, 1, 5) else "right", no_wrap=True,
                         overflow="ellipsis", max_width=14 if n == 0 else None)
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


def totals_text(data: DashboardData, narrow: bool = False, jobs: bool = True) -> Text:
    """The daemon's request counters (since `c`, if pressed): they add up to received; with `jobs`, the first
    running Batch API batch's progress too."""
    text = Text()
    for key, label in TOTALS:
        value = data.total(key)
        text.append(f"{SHORT_TOTALS[key] if narrow else label} ", style="dim")
        style = "bold red" if key == "failed" and value else ("bold yellow" if key == "overloaded" and value
                                                               else "bold")
        text.append(f"{value:,}", style=style)
        text.append("  ")
    text.append("in flight " if not narrow else "flying ", style="dim")
    text.append(str(data.stats.get("inflight", data.stats.get("totals", {}).get("in_flight", 0))), style="bold")
    running = data.stats.get("batch_jobs") or []  # the Batch API's batches still running
    if running and jobs:
        job = running[0]
        done = job.get("completed", 0) + job.get("failed", 0)
        text.append("  batch " if not narrow else "  b ", style="dim")
        text.append(f"{done:,}/{job.get('total', 0):,}", style="bold")
        text.append(f" {job.get('status', '')}" + (f" +{len(running) - 1}" if len(running) > 1 else ""), style="dim")
    return text


MAX_JOBS = 4  # Batch API batches listed one per line on a tall terminal


def jobs_renderable(data: DashboardData) -> Group:
    """The totals, then each running Batch API batch with its progress (a tall terminal's totals pane)."""
    grid = Table.grid(padding=(0, 2))
    jobs = data.stats.get("batch_jobs") or []
    for job in jobs[:MAX_JOBS]:
        done, failed, total = job.get("completed", 0), job.get("failed", 0), job.get("total", 0)
        counts = Text(f"{done + failed:,}/{total:,} lines")
        if failed:
            counts.append(f", {failed:,} failed", style="yellow")
        grid.add_row(Text(f"batch {job.get('id', '?')}", style="bold"), Text(str(job.get("status", "")), style="dim"),
                     Bar(float(total or 1), 0.0, float(done + failed), width=20, color="cyan", bgcolor="grey23"),
                     Text(f"{100 * (done + failed) / total:.0f} %" if total else "-", style="bold"), counts)
    parts: list = [totals_text(data, jobs=False), grid]
    if len(jobs) > MAX_JOBS:
        parts.append(Text(f"+{len(jobs) - MAX_JOBS} more batches", style="dim"))
    return Group(*parts)


class OverviewScreen(DashboardScreen):
    KEYS = [("c", "clear stats")]  # the app's key; shown where counters and sparklines are
    DEFAULT_CSS = """
    OverviewScreen #kpis { grid-size: 4; grid-gutter: 0 1; height: 1fr; min-height: 8; }
    OverviewScreen KpiCard { height: 1fr; }
    OverviewScreen KpiCard > Sparkline { height: 1fr; }
    OverviewScreen .panel { border: round $primary-darken-2; height: auto; padding: 0 1; }
    OverviewScreen #middle { height: auto; layout: vertical; }
    OverviewScreen.-wide #middle { layout: horizontal; }
    OverviewScreen.-wide #queues { width: 3fr; }
    OverviewScreen.-wide #device { width: 2fr; }
    OverviewScreen #totals, OverviewScreen #cache { height: 1; padding: 0 1; border: none; }
    OverviewScreen.-tall #totals { height: auto; border: round $primary-darken-2; }
    OverviewScreen.-tall #cache { height: auto; border: round $primary-darken-2; }
    """

    def body(self) -> ComposeResult:
        with Grid(id="kpis"):
            for key, title, _ in KPIS:
                yield KpiCard(title, id=f"kpi-{key}")
        with Horizontal(id="middle"):
            queue = Static(id="queues", classes="panel")
            queue.border_title = "queue per model and lane"
            yield queue
            device = Static(id="device", classes="panel")
            device.border_title = "device"
            yield device
        cache = Static(id="cache", classes="panel")
        cache.border_title = "state cache"
        yield cache
        totals = Static(id="totals", classes="panel")
        totals.border_title = "requests since start"
        yield totals

    def size_classes(self) -> None:
        super().size_classes()
        narrow = self.has_class("-narrow")
        for key, title, short in KPIS:
            for card in self.query(f"#kpi-{key}"):
                card.border_title = short if narrow else title

    def refresh_data(self, data: DashboardData) -> None:
        totals = data.stats.get("totals", {})
        limits = data.stats.get("limits", {})
        narrow = self.has_class("-narrow")

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
        self.query_one("#queues", Static).update(queue_table(data, narrow))
        # a bar per memory part (7 lines a GPU) where the terminal leaves the KPI cards room, else one line each
        gpus = len(data.device.get("gpus") or [])
        split = self.has_class("-tall") and 8 * gpus <= self.app.size.height - 26
        compact = gpus > 1 and not self.has_class("-tall")  # several GPUs on a short terminal: a line each
        self.query_one("#device", Static).update(device_renderable(
            data.device, data.stats.get("memory", {}), narrow, data.replicas(), tall=split, compact=compact))
        cache = self.query_one("#cache", Static)
        cache.border_title = "state cache since the clear" if data.cleared_at else "state cache"
        if self.has_class("-tall"):
            total = data.cache_total()
            cache.border_subtitle = f"cache setting {total['setting']}" if total.get("setting") else ""
            cache.update(cache_table(data, (cache.size.width or self.app.size.width) - 2))
        else:
            cache.update(cache_line(data, narrow))
        totals_pane = self.query_one("#totals", Static)
        totals_pane.border_title = "requests since the clear" if data.cleared_at else "requests since start"
        totals_pane.update(jobs_renderable(data) if self.has_class("-tall") and data.stats.get("batch_jobs")
                           else totals_text(data, narrow))

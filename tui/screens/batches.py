"""View 3: the last batches; the highlighted one as its prefix tree with token counts and owners; beside it the
histogram of requests per batch since the dashboard attached (or `c` cleared it)."""

from __future__ import annotations

from typing import Any

from rich.bar import Bar
from rich.table import Table
from rich.text import Text
from textual.app import ComposeResult
from textual.containers import Horizontal
from textual.widgets import DataTable, Static

from ..data import DashboardData
from ..widgets.batch_tree import BatchTree
from ..widgets.format import clock, ms, saving_line
from .base import DashboardScreen

SIZE_BUCKETS = [(1, 1), (2, 2), (3, 4), (5, 8), (9, 16), (17, 32), (33, 64), (65, None)]


def size_histogram(sizes: dict[int, int], width: int = 8) -> Table:
    """Batches per size bucket (requests in the batch: 1, 2, 3-4, ... 65+), one bar each, scaled to the largest."""
    counts = [sum(n for size, n in sizes.items() if lo <= size and (hi is None or size <= hi))
              for lo, hi in SIZE_BUCKETS]
    top = max(counts) or 1
    grid = Table.grid(padding=(0, 1))
    for (lo, hi), count in zip(SIZE_BUCKETS, counts):
        label = f"{lo}+" if hi is None else (str(lo) if lo == hi else f"{lo}-{hi}")
        grid.add_row(Text(f"{label:>5}"), Bar(top, 0, count, width=width, color="cyan", bgcolor="grey23"),
                     Text(str(count), style="bold" if count else "dim"))
    return grid


def histogram_subtitle(sizes: dict[int, int]) -> str:
    """`mean M of N`: requests per batch over the N batches counted."""
    batches = sum(sizes.values())
    if not batches:
        return "no batches"
    mean = sum(size * n for size, n in sizes.items()) / batches
    return f"mean {mean:.1f} of {batches}"


class BatchesScreen(DashboardScreen):
    AUTO_FOCUS = "#batches"
    KEYS = [("\u2191\u2193", "batch"), ("c", "clear")]
    DEFAULT_CSS = """
    BatchesScreen #batches { height: auto; max-height: 9; }
    BatchesScreen #saving { height: 1; }
    BatchesScreen #lower { height: 1fr; border-top: solid $primary-darken-2; }
    BatchesScreen BatchTree { height: 1fr; width: 1fr; }
    BatchesScreen #sizes { width: 23; height: auto; border: round $primary-darken-2; padding: 0 0; }
    """

    def __init__(self) -> None:
        super().__init__()
        self._ids: list[int] = []
        self.follow = True  # keep the newest batch highlighted until the user moves the cursor

    def body(self) -> ComposeResult:
        table: DataTable = DataTable(id="batches", cursor_type="row", zebra_stripes=True)
        for label in ("batch", "time", "model", "lane", "req", "q", "packed", "unpacked", "saved", "fwd", "ms"):
            table.add_column(label, key=label)
        yield table
        yield Static(id="saving")
        with Horizontal(id="lower"):
            yield BatchTree(id="tree")
            yield Static(id="sizes")

    def batch(self, data: DashboardData, batch_id: int | None) -> dict[str, Any] | None:
        for batch in data.batches:
            if batch.get("batch_id") == batch_id:
                return batch
        return None

    def refresh_data(self, data: DashboardData) -> None:
        table = self.query_one("#batches", DataTable)
        batches = list(reversed(data.batches))
        ids = [b.get("batch_id") for b in batches]
        if ids != self._ids:
            current = self._ids[table.cursor_row] if self._ids and table.cursor_row < len(self._ids) else None
            table.clear()
            for b in batches:
                packed, unpacked = b.get("packed_tokens", 0), b.get("unpacked_tokens", 0)
                saved = f"{100 * (1 - packed / unpacked):.0f} %" if unpacked else "-"
                table.add_row(str(b.get("batch_id")), clock(b.get("started")), b.get("model", ""), b.get("lane", ""),
                              str(b.get("requests")), str(b.get("questions")), f"{packed:,}", f"{unpacked:,}", saved,
                              str(b.get("forwards")), ms(b.get("compute_ms")), key=str(b.get("batch_id")))
            self._ids = ids
            if not self.follow and current in ids:
                table.move_cursor(row=ids.index(current))
        sizes = self.query_one("#sizes", Static)
        sizes.border_title = "req/batch"
        sizes.border_subtitle = histogram_subtitle(data.batch_sizes)
        sizes.update(size_histogram(data.batch_sizes))
        self._show_selected(data)

    def _show_selected(self, data: DashboardData) -> None:
        table = self.query_one("#batches", DataTable)
        selected = self._ids[table.cursor_row] if self._ids and table.cursor_row < len(self._ids) else None
        batch = self.batch(data, selected)
        saving = self.query_one("#saving", Static)
        if batch is None:
            saving.update("no batches yet: send a request")
        else:
            saving.update(saving_line(batch.get("packed_tokens", 0), batch.get("unpacked_tokens", 0), width=24))
        self.query_one(BatchTree).show(batch)

    def on_data_table_row_highlighted(self, event: DataTable.RowHighlighted) -> None:
        self.follow = event.cursor_row == 0
        self._show_selected(self.dashboard.data)

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
from ..widgets.batch_tree import CACHED, CACHED_STYLE, BatchTree, hit_tokens
from ..widgets.follow_table import FollowTable
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


def histogram_line(sizes: dict[int, int]) -> Text:
    """The histogram in one line for narrow terminals: `req/batch 1:0 2:1 3-4:1 (mean 2.5 of 2)`."""
    text = Text("req/batch ", style="bold")
    counts = [sum(n for size, n in sizes.items() if lo <= size and (hi is None or size <= hi)) for lo, hi in SIZE_BUCKETS]
    last = max([i for i, c in enumerate(counts) if c] or [1])  # empty buckets past the largest batch are left out
    for (lo, hi), count in list(zip(SIZE_BUCKETS, counts))[: last + 1]:
        label = f"{lo}+" if hi is None else (str(lo) if lo == hi else f"{lo}-{hi}")
        text.append(f"{label}:", style="dim")
        text.append(f"{count} ", style="bold" if count else "dim")
    return text.append(f"({histogram_subtitle(sizes)})")


def batch_cells(b: dict[str, Any]) -> tuple:
    packed, unpacked = b.get("packed_tokens", 0), b.get("unpacked_tokens", 0)
    saved = f"{100 * (1 - packed / unpacked):.0f} %" if unpacked else "-"
    mark = f" {CACHED}" if hit_tokens(b) else ""  # a row of it continued a state from the state cache
    return (Text(str(b.get("batch_id"))).append(mark, style=CACHED_STYLE), clock(b.get("started")), b.get("model", ""), b.get("lane", ""),
            str(b.get("requests")), str(b.get("questions")), f"{packed:,}", f"{unpacked:,}", saved,
            str(b.get("forwards")), ms(b.get("compute_ms")))


class BatchesScreen(DashboardScreen):
    """The list follows the newest batch while the cursor is on its first row; once the user moves the cursor the
    rows hold still (a held batch stays shown even after the dashboard's history let it go)."""

    AUTO_FOCUS = "#batches"
    KEYS = [("\u2191\u2193", "batch"), ("Home", "newest"), ("c", "clear")]
    DEFAULT_CSS = """
    BatchesScreen #batches { height: auto; max-height: 9; }
    BatchesScreen.-tall #batches { max-height: 40%; }
    BatchesScreen #saving { height: 1; }
    BatchesScreen #sizes-line { height: 1; display: none; }
    BatchesScreen.-narrow #sizes-line { display: block; }
    BatchesScreen #lower { height: 1fr; border-top: solid $primary-darken-2; }
    BatchesScreen BatchTree { height: 1fr; width: 1fr; }
    BatchesScreen #sizes { width: 23; height: auto; border: round $primary-darken-2; padding: 0 0; }
    BatchesScreen.-narrow #sizes { display: none; }
    """

    def __init__(self) -> None:
        super().__init__()
        self._shown: list[tuple[str, tuple]] = []
        self._held: dict[str, dict[str, Any]] = {}  # the batches on screen, by id, while holding
        self.holding = False

    def body(self) -> ComposeResult:
        table = FollowTable(id="batches", cursor_type="row", zebra_stripes=True)
        for label in ("batch", "time", "model", "lane", "req", "q", "packed", "unpacked", "saved", "fwd", "ms"):
            table.add_column(label, key=label)
        yield table
        yield Static(id="saving")
        yield Static(id="sizes-line")
        with Horizontal(id="lower"):
            yield BatchTree(id="tree")
            yield Static(id="sizes")

    def batch(self, data: DashboardData, batch_id: Any) -> dict[str, Any] | None:
        key = str(batch_id)
        for batch in data.batches:
            if str(batch.get("batch_id")) == key:
                return batch
        return self._held.get(key)

    def refresh_data(self, data: DashboardData) -> None:
        table = self.query_one("#batches", FollowTable)
        batches = list(reversed(data.batches))
        shown = [(str(b.get("batch_id")), batch_cells(b)) for b in batches]
        # the cursor off the first row means the user moved it (the view only ever puts it on row 0)
        self.holding = bool(self._shown) and table.cursor_row > 0
        if self.holding:
            for b in batches:
                if str(b.get("batch_id")) in self._held:
                    self._held[str(b.get("batch_id"))] = b
        elif [k for k, _ in shown] != [k for k, _ in self._shown]:
            table.rebuild(shown)
            self._shown = shown
            self._held = {str(b.get("batch_id")): b for b in batches}
        sizes = self.query_one("#sizes", Static)
        sizes.border_title = "req/batch"
        sizes.border_subtitle = histogram_subtitle(data.batch_sizes)
        sizes.update(size_histogram(data.batch_sizes))
        self.query_one("#sizes-line", Static).update(histogram_line(data.batch_sizes))
        self._show_selected(data)

    def _show_selected(self, data: DashboardData) -> None:
        table = self.query_one("#batches", FollowTable)
        row = table.cursor_row
        selected = self._shown[row][0] if self._shown and row < len(self._shown) else None
        batch = self.batch(data, selected)
        saving = self.query_one("#saving", Static)
        if batch is None:
            saving.update("no batches yet: send a request")
        else:
            packed, unpacked = batch.get("packed_tokens", 0), batch.get("unpacked_tokens", 0)
            newer = self.holding and data.batches and str(data.batches[-1].get("batch_id")) != self._shown[0][0]
            if newer:  # one line: the figures in words and why the list does not move
                saved = f"{100 * (1 - packed / unpacked):.0f} % saved" if unpacked else ""
                line = Text(f"{packed:,}/{unpacked:,} tok {saved}  ")
                line.append("held: newer batches above, Home shows them", style="bold yellow")
                saving.update(line)
            else:
                saving.update(saving_line(packed, unpacked, width=24))
        self.query_one(BatchTree).show(batch)

    def on_data_table_row_highlighted(self, event: DataTable.RowHighlighted) -> None:
        if event.cursor_row == 0 and self.holding:  # back at the top: follow the newest batches again
            self.redraw(force=True)
        else:
            self._show_selected(self.dashboard.data)

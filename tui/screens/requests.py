"""View 2: every recent request, newest first; `s` sorts, `/` filters, Enter opens one.

The list follows its top (new requests come into view) while the cursor is on the first row; once the user moves
the cursor the rows hold still (their cells still update) until Home or the first row brings the top back.
"""

from __future__ import annotations

from typing import Any

from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.widgets import DataTable, Input, Static

from ..data import DashboardData, client_name
from ..widgets.follow_table import FollowTable
from ..widgets.format import clock, ms, short_id
from .base import DashboardScreen

# (row field, label, narrow label, priority): columns go by priority, lowest first, when the terminal is too
# narrow for them; what is left is shown whole (no horizontal scroll hides model, client or endpoint)
COLUMNS = [("id", "id", "id", 10), ("ts", "time", "time", 10), ("status", "status", "status", 10),
           ("queue_ms", "queue ms", "queue", 9), ("compute_ms", "compute ms", "comp", 9), ("model", "model", "model", 8),
           ("client", "client", "client", 8), ("endpoint", "endpoint", "api", 7), ("questions", "q", "q", 5),
           ("input_tokens", "in tok", "tok", 4), ("cached_tokens", "cached", "cache", 3.5),
           ("batch_id", "batch", "batch", 3), ("lane", "lane", "lane", 2), ("total_ms", "total ms", "total", 1)]
# width of each column's content at most (model and client are cut to it), plus DataTable's padding of 2
WIDTH = {"id": 10, "ts": 8, "status": 6, "queue_ms": 5, "compute_ms": 5, "model": 12, "client": 12, "endpoint": 9,
         "questions": 3, "input_tokens": 6, "cached_tokens": 6, "batch_id": 5, "lane": 6, "total_ms": 5}
NARROW_WIDTH = {"model": 10, "client": 10, "endpoint": 5}
SHORT_STATUS = {"received": "recv", "planned": "plan", "queued": "queue", "computing": "run"}
# `s` cycles through these: (label, row field, newest/largest first)
SORTS = [("time", "ts", True), ("queue ms", "queue_ms", True), ("compute ms", "compute_ms", True),
         ("cached tokens", "cached_tokens", True),
         ("status", "status", False), ("model", "model", False), ("client", "client", False)]


def columns_for(width: int, cells: list[tuple] | None = None) -> list[tuple[str, str]]:
    """(field, label) of the columns that fit `width` cells, in table order; `cells` (every column's cells of the
    rows shown) measure the columns as DataTable will, else each column's widest content is assumed."""
    narrow = width < 100
    labels = [short if narrow else label for _, label, short, _ in COLUMNS]
    widths = {**WIDTH, **(NARROW_WIDTH if narrow else {})}
    measured = {}
    for n, (field, _, _, _) in enumerate(COLUMNS):
        content = max((Text(c[n]).cell_len if isinstance(c[n], str) else c[n].cell_len for c in cells), default=1) \
            if cells else widths[field]
        measured[field] = max(len(labels[n]), content)
    kept = [(c[0], labels[n], c[3]) for n, c in enumerate(COLUMNS)]
    while sum(measured[f] + 2 for f, _, _ in kept) + 2 > width and len(kept) > 5:
        kept.remove(min(kept, key=lambda c: c[2]))
    return [(field, label) for field, label, _ in kept]


def matches(row: dict[str, Any], query: str) -> bool:
    """Every word must match: `>N` = slower than N ms in total, else a substring of id/client/model/endpoint/status."""
    for word in query.lower().split():
        if word.startswith(">"):
            try:
                limit = float(word[1:])
            except ValueError:
                return False
            total = row.get("total_ms") or (row.get("queue_ms", 0) or 0) + (row.get("compute_ms", 0) or 0)
            if total <= limit:
                return False
            continue
        haystack = " ".join(str(row.get(k, "")) for k in ("id", "model", "endpoint", "status", "lane"))
        haystack += " " + client_name(row.get("client", ""))
        if word not in haystack.lower():
            return False
    return True


def status_cell(status: Any) -> Text:
    if isinstance(status, int):
        style = "green" if status < 400 else ("yellow" if status < 500 or status == 529 else "red")
        return Text(str(status), style=style)
    return Text(SHORT_STATUS.get(str(status), str(status or "-")), style="italic")


def cell(row: dict[str, Any], field: str, narrow: bool = False) -> Any:
    """One cell of a request's row; model, client and endpoint cut to their column's width."""
    value = row.get(field)
    if field == "id":
        return short_id(row["id"], 10)
    if field == "ts":
        return clock(value)
    if field == "status":
        return status_cell(value)
    if field in ("queue_ms", "compute_ms", "total_ms"):
        return ms(value)
    if field in ("model", "client", "endpoint"):
        text = client_name(value or "") if field == "client" else str(value or "-")
        if field == "endpoint" and narrow:
            text = {"systemone": "s1"}.get(text, text)
        return short_id(text, (NARROW_WIDTH if narrow else WIDTH)[field])
    return str(value if value not in (None, "") else "-")


def row_cells(row: dict[str, Any], fields: list[str] | None = None, narrow: bool = False) -> tuple:
    return tuple(cell(row, f, narrow) for f in (fields or [c[0] for c in COLUMNS]))


def sort_key(field: str):
    def key(row: dict[str, Any]):
        value = row.get(field)
        if isinstance(value, int | float):
            return (0, value, "")
        return (1, 0, str(value or ""))
    return key


class RequestsScreen(DashboardScreen):
    BINDINGS = [Binding("slash", "filter", "Filter", key_display="/"), Binding("s", "sort", "Sort"),
                Binding("escape", "clear_filter", "Clear", show=False)]
    AUTO_FOCUS = "#requests"
    KEYS = [("Enter", "open"), ("/", "filter"), ("s", "sort"), ("Home", "top")]
    DEFAULT_CSS = """
    RequestsScreen #filter { height: 3; }
    RequestsScreen #requests-info { height: 1; color: $text-muted; }
    RequestsScreen DataTable { height: 1fr; }
    """

    def __init__(self) -> None:
        super().__init__()
        self.query_text = ""
        self.sort_index = 0
        self._shown: list[tuple[str, tuple]] = []
        self._columns: list[tuple[str, str]] = []
        self._reset = False  # a new sort or filter: rebuild and go to the top
        self.holding = False  # the user moved the cursor: rows stay where they are

    def body(self) -> ComposeResult:
        box = Input(placeholder="filter: words, >200 = slower than 200 ms; Enter keeps, Esc clears", id="filter")
        box.display = False
        yield box
        yield Static(id="requests-info")
        yield FollowTable(id="requests", cursor_type="row", zebra_stripes=True)

    def visible_rows(self, data: DashboardData) -> list[dict[str, Any]]:
        label, field, reverse = SORTS[self.sort_index]
        rows = [r for r in data.requests.values() if matches(r, self.query_text)]
        known = [r for r in rows if r.get(field) is not None]
        missing = [r for r in rows if r.get(field) is None]  # e.g. no queue time: rejected before the queue
        return sorted(known, key=sort_key(field), reverse=reverse) + missing

    def refresh_data(self, data: DashboardData) -> None:
        table = self.query_one(FollowTable)
        width = self.size.width or self.app.size.width
        narrow = width < 100
        rows = self.visible_rows(data)
        every = [row_cells(r, None, narrow) for r in rows]
        columns = columns_for(width, every)
        if columns != self._columns:
            table.clear(columns=True)
            for field, label in columns:
                table.add_column(label, key=field)
            self._columns, self._shown = columns, []
        fields = [f for f, _ in columns]
        index = [n for n, c in enumerate(COLUMNS) if c[0] in fields]
        label, _, _ = SORTS[self.sort_index]
        shown = [(r["id"], tuple(cells[n] for n in index)) for r, cells in zip(rows, every)]
        # the cursor off the first row means the user moved it (the view only ever puts it on row 0)
        self.holding = bool(self._shown) and table.cursor_row > 0 and not self._reset
        if self.holding:
            by_id = dict(shown)
            current = [(key, by_id.get(key, old)) for key, old in self._shown]
            self._update_cells(table, fields, current)
            self._shown = current
            known = {key for key, _ in current}
            newer = sum(1 for key, _ in shown if key not in known)
        else:
            if [k for k, _ in shown] == [k for k, _ in self._shown]:
                self._update_cells(table, fields, shown)
            else:
                table.rebuild(shown)
            self._shown, newer = shown, 0
        self._reset = False
        info = f"{len(rows)} of {len(data.requests)} requests, sorted by {label}"
        if self.query_text:
            info += f", filter {self.query_text!r}"
        if self.holding:
            info += f"; held: {newer} new, Home goes to the top" if newer else "; held, Home goes to the top"
        self.query_one("#requests-info", Static).update(info)

    def _update_cells(self, table: FollowTable, fields: list[str], rows: list[tuple[str, tuple]]) -> None:
        old = dict(self._shown)
        for key, cells in rows:
            before = old.get(key)
            if before is not None and cells != before:
                for field, value, was in zip(fields, cells, before):
                    if value != was:
                        table.update_cell(key, field, value)

    def selected_id(self) -> str | None:
        table = self.query_one(FollowTable)
        if not self._shown or table.cursor_row >= len(self._shown):
            return None
        return self._shown[table.cursor_row][0]

    def on_data_table_row_selected(self, event: DataTable.RowSelected) -> None:
        self.dashboard.open_request(str(event.row_key.value))

    def on_data_table_row_highlighted(self, event: DataTable.RowHighlighted) -> None:
        if event.cursor_row == 0 and self.holding:  # back at the top: follow the list again
            self.redraw(force=True)

    def action_filter(self) -> None:
        box = self.query_one("#filter", Input)
        box.display = True
        box.focus()

    def _top(self) -> None:
        self._reset = True
        table = self.query_one(FollowTable)
        with table.prevent(DataTable.RowHighlighted):
            table.move_cursor(row=0, animate=False)
        self.refresh_data(self.dashboard.data)

    def on_input_changed(self, event: Input.Changed) -> None:
        self.query_text = event.value.strip()
        self._top()

    def on_input_submitted(self, event: Input.Submitted) -> None:
        event.input.display = False
        self.query_one(FollowTable).focus()

    def action_clear_filter(self) -> None:
        box = self.query_one("#filter", Input)
        with self.prevent(Input.Changed):
            box.value = ""
        box.display = False
        self.query_text = ""
        self.query_one(FollowTable).focus()
        self._top()

    def action_sort(self) -> None:
        """The next sort, shown from its top (htop, k9s)."""
        self.sort_index = (self.sort_index + 1) % len(SORTS)
        self._top()

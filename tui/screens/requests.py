"""View 2: every recent request, newest first; `s` sorts, `/` filters, Enter opens one."""

from __future__ import annotations

from typing import Any

from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.widgets import DataTable, Input, Static

from ..data import DashboardData, client_name
from ..widgets.format import clock, ms, short_id
from .base import DashboardScreen

# what matters most first, so 80 columns show it; the rest scrolls in
COLUMNS = [("id", "id"), ("time", "time"), ("status", "status"), ("queue ms", "queue_ms"), ("compute ms", "compute_ms"),
           ("batch", "batch_id"), ("q", "questions"), ("in tok", "input_tokens"), ("model", "model"),
           ("client", "client"), ("endpoint", "endpoint")]
# `s` cycles through these: (label, row field, newest/largest first)
SORTS = [("time", "ts", True), ("queue ms", "queue_ms", True), ("compute ms", "compute_ms", True),
         ("status", "status", False), ("model", "model", False), ("client", "client", False)]


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
    return Text(str(status or "-"), style="italic")


def row_cells(row: dict[str, Any]) -> tuple:
    return (short_id(row["id"], 10), clock(row.get("ts")), status_cell(row.get("status")), ms(row.get("queue_ms")),
            ms(row.get("compute_ms")), str(row.get("batch_id", "-") or "-"), str(row.get("questions", "-")),
            str(row.get("input_tokens", "-")), row.get("model", "-") or "-", client_name(row.get("client", "")),
            row.get("endpoint", "-") or "-")


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
    KEYS = [("Enter", "open"), ("/", "filter"), ("s", "sort"), ("Esc", "clear")]
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

    def body(self) -> ComposeResult:
        box = Input(placeholder="filter: words, >200 = slower than 200 ms; Enter keeps, Esc clears", id="filter")
        box.display = False
        yield box
        yield Static(id="requests-info")
        table: DataTable = DataTable(id="requests", cursor_type="row", zebra_stripes=True)
        for label, key in COLUMNS:
            table.add_column(label, key=key)
        yield table

    def visible_rows(self, data: DashboardData) -> list[dict[str, Any]]:
        label, field, reverse = SORTS[self.sort_index]
        rows = [r for r in data.requests.values() if matches(r, self.query_text)]
        known = [r for r in rows if r.get(field) is not None]
        missing = [r for r in rows if r.get(field) is None]  # e.g. no queue time: rejected before the queue
        return sorted(known, key=sort_key(field), reverse=reverse) + missing

    def refresh_data(self, data: DashboardData) -> None:
        label, _, _ = SORTS[self.sort_index]
        rows = self.visible_rows(data)
        info = f"{len(rows)} of {len(data.requests)} requests, sorted by {label}"
        if self.query_text:
            info += f", filter {self.query_text!r}"
        self.query_one("#requests-info", Static).update(info)
        table = self.query_one(DataTable)
        shown = [(r["id"], row_cells(r)) for r in rows]
        if [k for k, _ in shown] == [k for k, _ in self._shown]:
            for (key, cells), (_, old) in zip(shown, self._shown):
                if cells != old:
                    for (_, column), value, before in zip(COLUMNS, cells, old):
                        if value != before:
                            table.update_cell(key, column, value)
        else:
            current = None
            if table.row_count and table.cursor_row < len(self._shown):
                current = self._shown[table.cursor_row][0]
            table.clear()
            for key, cells in shown:
                table.add_row(*cells, key=key)
            keys = [k for k, _ in shown]
            if current in keys:
                table.move_cursor(row=keys.index(current))
        self._shown = shown

    def selected_id(self) -> str | None:
        table = self.query_one(DataTable)
        if not self._shown or table.cursor_row >= len(self._shown):
            return None
        return self._shown[table.cursor_row][0]

    def on_data_table_row_selected(self, event: DataTable.RowSelected) -> None:
        self.dashboard.open_request(str(event.row_key.value))

    def action_filter(self) -> None:
        box = self.query_one("#filter", Input)
        box.display = True
        box.focus()

    def on_input_changed(self, event: Input.Changed) -> None:
        self.query_text = event.value.strip()
        self.refresh_data(self.dashboard.data)

    def on_input_submitted(self, event: Input.Submitted) -> None:
        event.input.display = False
        self.query_one(DataTable).focus()

    def action_clear_filter(self) -> None:
        box = self.query_one("#filter", Input)
        box.value = ""
        box.display = False
        self.query_text = ""
        self.query_one(DataTable).focus()
        self.refresh_data(self.dashboard.data)

    def action_sort(self) -> None:
        self.sort_index = (self.sort_index + 1) % len(SORTS)
        self.refresh_data(self.dashboard.data)

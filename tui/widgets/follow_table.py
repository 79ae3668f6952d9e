"""A DataTable for lists that grow at the top (requests, batches): Home goes back to the newest row.

The views follow the top of their list while the cursor is on the first row and hold the rows still once the
user moved it (htop, k9s); rebuilding never posts a highlight, so nothing the view does looks like a keypress.
"""

from __future__ import annotations

from textual.binding import Binding
from textual.widgets import DataTable


class FollowTable(DataTable):
    BINDINGS = [Binding("home", "scroll_top", "Top", show=False), Binding("g", "scroll_top", "Top", show=False)]

    def rebuild(self, rows: list[tuple[str, tuple]], cursor: int = 0) -> None:
        """All rows anew (key, cells), the cursor on row `cursor`, without a RowHighlighted of our own."""
        with self.prevent(DataTable.RowHighlighted):
            self.clear()
            for key, cells in rows:
                self.add_row(*cells, key=key)
            if rows:
                self.move_cursor(row=min(cursor, len(rows) - 1), animate=False)

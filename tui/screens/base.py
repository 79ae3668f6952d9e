"""The frame of every view: the status line on top, the view's body, the key footer below."""

from __future__ import annotations

from typing import TYPE_CHECKING

from textual.app import ComposeResult
from textual.css.query import NoMatches
from textual.screen import Screen

from ..data import DashboardData
from ..widgets.keybar import KeyBar
from ..widgets.status import StatusBar

if TYPE_CHECKING:
    from ..app import DashboardApp


class DashboardScreen(Screen):
    """A view: `body()` yields its widgets, `refresh_data()` redraws them from the data."""

    KEYS: list[tuple[str, str]] = []  # the view's own keys, shown before the common ones

    def compose(self) -> ComposeResult:
        yield StatusBar(id="status")
        yield from self.body()
        yield KeyBar(self.KEYS)

    def body(self) -> ComposeResult:
        yield from ()

    @property
    def dashboard(self) -> DashboardApp:
        return self.app  # type: ignore[return-value]

    _drawn: tuple | None = None

    def on_screen_resume(self) -> None:
        self.size_classes()
        self.redraw(force=True)

    def on_resize(self) -> None:
        self.size_classes()
        self.redraw(force=True)

    def size_classes(self) -> None:
        """`-narrow` (under 100 columns), `-wide` (160 and more), `-tall` (36 lines and more): the .tcss lays
        each view out for the terminal from these."""
        width, height = self.app.size
        self.set_class(width < 100, "-narrow")
        self.set_class(width >= 160, "-wide")
        self.set_class(height >= 36, "-tall")

    def redraw(self, force: bool = False) -> None:
        """Redraw when the data changed or a second passed (rates, uptime); otherwise do nothing."""
        data = self.dashboard.data
        key = (data.version, int(data.clock()), self.dashboard.paused)
        if key == self._drawn and not force:
            return
        self.set_class(not data.connected, "-disconnected")  # the .tcss greys the numbers: they are stale
        try:
            self.query_one(StatusBar).show(data, self.dashboard.paused)
            self.refresh_data(data)
        except NoMatches:  # still composing: the next tick draws it
            return
        self._drawn = key

    def refresh_data(self, data: DashboardData) -> None:
        """Draw the view's body from the data (called on the refresh tick while this view is shown)."""

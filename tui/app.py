"""The dashboard app: five views on keys 1-5, a refresh tick, data from one Source (client.py).

The source runs as an async worker on Textual's loop and calls `daemon_stats` / `daemon_event` / `daemon_connection`;
those only fold data into `DashboardData`. The views redraw on a timer (`+`/`-` change its period, `p`
pauses it), so a burst of events costs one redraw.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from textual import events, work
from textual.app import App, ScreenStackError
from textual.binding import Binding
from textual.timer import Timer

from .client import Source
from .data import DashboardData, LogLine
from .screens.base import DashboardScreen
from .screens.batches import BatchesScreen
from .screens.detail import RequestDetailScreen
from .screens.help import HelpScreen
from .screens.log import LogScreen
from .screens.models import ModelsScreen
from .screens.overview import OverviewScreen
from .screens.requests import RequestsScreen

REFRESH_STEPS = [0.25, 0.5, 1.0, 2.0, 5.0]


class DashboardApp(App):
    CSS_PATH = "dashboard.tcss"
    TITLE = "basal-local top"
    MODES = {"overview": OverviewScreen, "requests": RequestsScreen, "batches": BatchesScreen,
             "models": ModelsScreen, "log": LogScreen}
    DEFAULT_MODE = "overview"
    BINDINGS = [
        Binding("q", "quit", "Quit"),
        Binding("ctrl+c", "quit", "Quit", show=False, priority=True),  # what the banner and every terminal say
        Binding("question_mark", "help", "Help", key_display="?"),
        Binding("p", "pause", "Pause"),
        Binding("1", "switch_mode('overview')", "Overview"),
        Binding("2", "switch_mode('requests')", "Requests"),
        Binding("3", "switch_mode('batches')", "Batches"),
        Binding("4", "switch_mode('models')", "Models"),
        Binding("5", "switch_mode('log')", "Log"),
        Binding("c", "clear_stats", "Clear stats"),
        Binding("plus", "faster", "Faster", key_display="+"),
        Binding("minus", "slower", "Slower", key_display="-"),
        Binding("enter", "open_request", "Open", show=False),
    ]

    def __init__(self, source: Source, clock: Callable[[], float] = time.time, refresh_s: float = 0.5,
                 follow: bool = True, capture_print: bool = False, owns_daemon: bool = False) -> None:
        super().__init__()
        self.owns_daemon = owns_daemon  # serve --tui: quitting stops the daemon, and the key bar says so
        self.capture_print = capture_print  # serve --tui: prints of the daemon go to the log pane
        self.source = source
        self.data = DashboardData(clock=clock, url=source.url)
        self.paused = False
        self.refresh_s = refresh_s
        self.follow = follow  # False in tests that feed the data by hand
        self._timer: Timer | None = None
        self._drawn = -1

    # ---- lifecycle -----------------------------------------------------------------------------------------
    def on_mount(self) -> None:
        self._timer = self.set_interval(self.refresh_s, self.tick)
        if self.capture_print:
            self.begin_capture_print(self)
        if self.follow:
            self.run_source()

    @work(exclusive=True, group="source")
    async def run_source(self) -> None:
        await self.source.run(self)

    # ---- sink (called by the source on this loop) ----------------------------------------------------------
    def daemon_stats(self, snapshot: dict[str, Any]) -> None:
        self.data.load_stats(snapshot)

    def daemon_event(self, event: dict[str, Any]) -> None:
        self.data.apply(event)

    def daemon_connection(self, connected: bool, error: str = "") -> None:
        changed = connected != self.data.connected
        self.data.set_connected(connected, error)
        if changed:
            self.redraw(force=True)  # a lost daemon shows at once, even when paused

    def on_print(self, event: events.Print) -> None:
        text = event.text.strip()
        if text:
            self.data.add_log(LogLine(time.time(), "WARNING" if event.stderr else "INFO", "daemon", text))

    # ---- drawing -------------------------------------------------------------------------------------------
    def tick(self) -> None:
        if not self.paused:
            self.redraw()

    def redraw(self, force: bool = False) -> None:
        try:
            screen = self.screen
        except ScreenStackError:  # starting or closing: nothing to draw on
            return
        if isinstance(screen, DashboardScreen) and screen.is_mounted:
            screen.redraw(force)

    # ---- actions -------------------------------------------------------------------------------------------
    def action_help(self) -> None:
        if not isinstance(self.screen, HelpScreen):
            self.push_screen(HelpScreen(self.owns_daemon))

    def action_pause(self) -> None:
        self.paused = not self.paused
        self.redraw_status()
        self.say("paused: the data keeps coming, the display waits" if self.paused else "resumed")

    def action_clear_stats(self) -> None:
        self.data.clear()
        self.redraw(force=True)
        self.say("statistics cleared here; the daemon's counters are untouched")

    def say(self, text: str) -> None:
        """One toast at a time: a new one replaces the last (ten `+` presses must not cover the screen)."""
        self.clear_notifications()
        self.notify(text, timeout=2)

    def redraw_status(self) -> None:
        self.redraw(force=True)

    def _set_refresh(self, step: int) -> None:
        index = min(range(len(REFRESH_STEPS)), key=lambda i: abs(REFRESH_STEPS[i] - self.refresh_s))
        index = max(0, min(len(REFRESH_STEPS) - 1, index + step))
        self.refresh_s = REFRESH_STEPS[index]
        if self._timer is not None:
            self._timer.stop()
        self._timer = self.set_interval(self.refresh_s, self.tick)
        self.say(f"refresh every {self.refresh_s:g} s")

    def action_faster(self) -> None:
        self._set_refresh(-1)

    def action_slower(self) -> None:
        self._set_refresh(+1)

    def action_open_request(self) -> None:
        screen = self.screen
        if isinstance(screen, RequestsScreen):
            request_id = screen.selected_id()
            if request_id:
                self.open_request(request_id)

    @work(exclusive=True, group="detail")
    async def open_request(self, request_id: str) -> None:
        """Fetch the request's questions and answers from the daemon and show them."""
        row = dict(self.data.requests.get(request_id) or {"id": request_id})
        record = await self.source.request(request_id)
        if record:
            row.update(record)
        if isinstance(self.screen, RequestDetailScreen):
            self.pop_screen()
        self.push_screen(RequestDetailScreen(row, self.data.thresholds(row.get("model", ""))))

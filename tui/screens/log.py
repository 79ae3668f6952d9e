"""View 5: the daemon's log (through the event stream) and the dashboard's own notes.

`l` cycles the lowest level shown (DEBUG, INFO, WARNING, ERROR): the pane is rewritten from the kept lines.
`f` follows the tail (new lines scroll into view) or holds the view where it is while lines keep arriving.
`a` adds the access log: one line per finished request, built from the event stream (no `--access-log` needed).
"""

from __future__ import annotations

from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.widgets import RichLog, Static

from ..data import MAX_LOG, DashboardData, LogLine
from ..widgets.format import clock
from .base import DashboardScreen

LEVEL_STYLE = {"ERROR": "bold red", "CRITICAL": "bold red", "WARNING": "yellow", "INFO": "", "DEBUG": "dim"}
LEVELS = ["DEBUG", "INFO", "WARNING", "ERROR"]
RANK = {"DEBUG": 10, "INFO": 20, "WARNING": 30, "ERROR": 40, "CRITICAL": 50}


def log_text(line: LogLine) -> Text:
    text = Text(f"{clock(line.ts)} ", style="dim")
    text.append(f"{line.level:<7} ", style=LEVEL_STYLE.get(line.level, ""))
    text.append(f"{line.source}: ", style="bold")
    text.append(line.message)
    return text


def shown(line: LogLine, level: str) -> bool:
    return RANK.get(line.level.upper(), 20) >= RANK[level]


class LogScreen(DashboardScreen):
    KEYS = [("l", "level"), ("f", "follow"), ("a", "access")]
    BINDINGS = [Binding("l", "cycle_level", "Level"), Binding("f", "toggle_follow", "Follow"),
                Binding("a", "toggle_access", "Access log")]
    DEFAULT_CSS = """
    LogScreen #log-state { height: 1; background: $boost; }
    """

    def __init__(self) -> None:
        super().__init__()
        self._seen: set[LogLine] = set()  # the lines already considered (written, or below the level)
        self.level = "DEBUG"
        self.follow = True
        self.access = False  # `a`: one line per finished request, from the event stream
        self.held = 0  # lines that arrived while not following

    def body(self) -> ComposeResult:
        yield Static(id="log-state")
        yield RichLog(max_lines=2 * MAX_LOG, wrap=True, id="log")

    def state_text(self) -> Text:
        text = Text(f" level \u2265 {self.level}", style="bold")
        text.append("   access log " + ("shown" if self.access else "hidden (a)"))
        if self.follow:
            text.append("   following the tail")
        else:
            text.append("   HOLDING", style="bold yellow")
            text.append(f": {self.held} new line(s) below; f follows again")
        return text

    def refresh_data(self, data: DashboardData) -> None:
        pane = self.query_one(RichLog)
        lines = list(data.log)
        if self.access:
            lines = sorted(lines + list(data.access), key=lambda line: line.ts)
        new = [line for line in lines if line not in self._seen]
        fresh = [line for line in new if shown(line, self.level)]
        if new and lines[len(lines) - len(new):] != new:  # a line landed before ones already written
            pane.clear()
            for line in lines:
                if shown(line, self.level):
                    pane.write(log_text(line), scroll_end=self.follow)
        else:
            for line in fresh:
                pane.write(log_text(line), scroll_end=self.follow)
        if not self.follow:
            self.held += len(fresh)
        self._seen = set(lines)
        self.query_one("#log-state", Static).update(self.state_text())

    def on_resize(self) -> None:
        self.size_classes()
        self.rewrite()  # RichLog wraps at write time: lines written before the layout wrapped at the wrong width

    def rewrite(self) -> None:
        """Write the kept lines again under the current level."""
        self.query_one(RichLog).clear()
        self._seen = set()
        self.held = 0
        self.redraw(force=True)

    def action_cycle_level(self) -> None:
        self.level = LEVELS[(LEVELS.index(self.level) + 1) % len(LEVELS)]
        self.rewrite()

    def action_toggle_access(self) -> None:
        self.access = not self.access
        self.rewrite()

    def action_toggle_follow(self) -> None:
        self.follow = not self.follow
        pane = self.query_one(RichLog)
        pane.auto_scroll = self.follow
        if self.follow:
            self.held = 0
            pane.scroll_end(animate=False)
        self.redraw(force=True)

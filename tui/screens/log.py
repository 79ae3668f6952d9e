"""View 5: the daemon's log (through the event stream) and the dashboard's own notes."""

from __future__ import annotations

from rich.text import Text
from textual.app import ComposeResult
from textual.widgets import RichLog

from ..data import MAX_LOG, DashboardData, LogLine
from ..widgets.format import clock
from .base import DashboardScreen

LEVEL_STYLE = {"ERROR": "bold red", "CRITICAL": "bold red", "WARNING": "yellow", "INFO": "", "DEBUG": "dim"}


def log_text(line: LogLine) -> Text:
    text = Text(f"{clock(line.ts)} ", style="dim")
    text.append(f"{line.level:<7} ", style=LEVEL_STYLE.get(line.level, ""))
    text.append(f"{line.source}: ", style="bold")
    text.append(line.message)
    return text


class LogScreen(DashboardScreen):
    def __init__(self) -> None:
        super().__init__()
        self._written: LogLine | None = None  # the last line written (the deque drops old lines)

    def body(self) -> ComposeResult:
        yield RichLog(max_lines=MAX_LOG, wrap=True, id="log")

    def refresh_data(self, data: DashboardData) -> None:
        pane = self.query_one(RichLog)
        lines = list(data.log)
        start = 0
        if self._written is not None:
            for i in range(len(lines) - 1, -1, -1):
                if lines[i] is self._written:
                    start = i + 1
                    break
        for line in lines[start:]:
            pane.write(log_text(line))
        if lines:
            self._written = lines[-1]

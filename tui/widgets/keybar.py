"""The key line at the bottom: a plain Static (Textual's Footer re-mounts a widget per key on every switch).

Laid out for the width: when the keys do not fit, the least needed go first (speed, pause, the view numbers);
`q` always stays, and under `serve --tui` it says that quitting stops the daemon.
"""

from __future__ import annotations

from rich.text import Text
from textual.widgets import Static

# (key, what, priority): lower goes first when the line is too long
COMMON = [("1-5", "views", 3), ("?", "help", 4), ("q", "quit", 9), ("p", "pause", 2), ("+/-", "speed", 1)]
QUIT_STOPS_DAEMON = "quit + stop daemon"


def keys_text(extra: list[tuple[str, str]], width: int = 200, owns_daemon: bool = False) -> Text:
    items = [(key, what, 5) for key, what in extra]
    items += [(k, QUIT_STOPS_DAEMON if k == "q" and owns_daemon else w, p) for k, w, p in COMMON]

    def length(entries: list[tuple[str, str, int]]) -> int:
        return sum(len(key) + len(what) + 2 for key, what, _ in entries)

    while length(items) > width and any(p < 9 for _, _, p in items):
        items.remove(min((i for i in items if i[2] < 9), key=lambda i: i[2]))
    text = Text(no_wrap=True, overflow="ellipsis")
    for key, what, _ in items:  # one space apart: the requests view's keys fit 80 columns
        text.append(" ")
        text.append(key, style="bold reverse")
        text.append(f" {what}")
    return text


class KeyBar(Static):
    DEFAULT_CSS = """
    KeyBar { height: 1; dock: bottom; background: $panel; }
    """

    def __init__(self, extra: list[tuple[str, str]]) -> None:
        super().__init__()
        self.extra = extra

    def render(self) -> Text:
        return keys_text(self.extra, self.size.width or 80, self.app.owns_daemon)  # type: ignore[attr-defined]

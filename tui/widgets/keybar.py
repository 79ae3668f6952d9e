"""The key line at the bottom: a plain Static (Textual's Footer re-mounts a widget per key on every switch)."""

from __future__ import annotations

from rich.text import Text
from textual.widgets import Static

COMMON = [("1-5", "views"), ("?", "help"), ("q", "quit"), ("p", "pause"), ("+/-", "speed")]


def keys_text(extra: list[tuple[str, str]]) -> Text:
    text = Text()
    for key, what in extra + COMMON:  # one space apart: the requests view's keys fit 80 columns
        text.append(" ")
        text.append(key, style="bold reverse")
        text.append(f" {what}")
    return text


class KeyBar(Static):
    DEFAULT_CSS = """
    KeyBar { height: 1; dock: bottom; background: $panel; }
    """

    def __init__(self, extra: list[tuple[str, str]]) -> None:
        super().__init__(keys_text(extra))

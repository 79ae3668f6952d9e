"""The one-line header every view shares: state, address, backend, models, uptime, PAUSED, the disconnect reason.

It is laid out for the terminal's width: parts of low priority (version, uptime, models) go first, so `PAUSED`
and the reason for a disconnect always fit, even at 80 columns.
"""

from __future__ import annotations

from rich.text import Text
from textual.widgets import Static

from ..data import DashboardData
from .format import duration

# (priority: lower goes last, text, style); the order on screen is the list's order
Part = tuple[int, str, str]


def status_parts(data: DashboardData, paused: bool, narrow: bool) -> list[Part]:
    s = data.stats
    url = data.url.removeprefix("http://") if narrow else data.url
    parts: list[Part] = [(9, " basal " if narrow else " basal-local ", "bold reverse")]
    if not data.connected:
        parts += [(10, " DISCONNECTED ", "bold white on red"), (6, f" {url}", ""),
                  (10, f" retrying: {data.error or 'connecting'}", "red")]
    else:
        if s.get("ready"):
            parts.append((10, " ready ", "bold black on green"))
        elif s.get("load_error"):
            parts.append((10, " error ", "bold white on red"))
        else:
            parts.append((10, " loading ", "bold black on yellow"))
        moving = [f" {e['status']} {e['name']} " for e in data.model_states() if e["status"] in ("loading", "unloading")]
        if moving and s.get("ready"):  # a model loads or unloads while the others serve
            parts.append((9, moving[0] + (f"+{len(moving) - 1} " if len(moving) > 1 else ""), "bold black on yellow"))
        backend = "/".join(x for x in (s.get("backend"), s.get("device"), s.get("dtype")) if x)
        models = ", ".join(m.get("name", "") for m in s.get("models", []))
        parts += [(7, f" {url}", ""), (8, f"  {backend or '-'}", ""), (5, f"  {models or '-'}", ""),
                  (4, f"  up {duration(data.uptime())}", ""), (1, f"  v{s.get('version', '?')}", "dim")]
    if paused:
        parts.append((10, "  PAUSED ", "bold black on yellow"))
    return parts


def status_text(data: DashboardData, paused: bool = False, width: int = 200) -> Text:
    parts = status_parts(data, paused, narrow=width < 100)
    while sum(len(t) for _, t, _ in parts) > width:
        droppable = [p for p in parts if p[0] < 10]
        if not droppable:
            break
        parts.remove(min(droppable, key=lambda p: p[0]))
    text = Text(no_wrap=True, overflow="ellipsis")
    for _, part, style in parts:
        text.append(part, style=style)
    if text.cell_len > width:  # only a long disconnect reason is left to cut; PAUSED stays at the end
        tail = Text("  PAUSED ", style="bold black on yellow") if paused else Text()
        text.truncate(width - tail.cell_len, overflow="ellipsis")
        text.append_text(tail)
    return text


class StatusBar(Static):
    DEFAULT_CSS = """
    StatusBar { height: 1; background: $panel; }
    """

    def __init__(self, id: str | None = None) -> None:
        super().__init__(id=id)
        self._state: tuple[DashboardData, bool] | None = None

    def show(self, data: DashboardData, paused: bool) -> None:
        self._state = (data, paused)
        self.refresh()

    def render(self) -> Text:
        if self._state is None:
            return Text("")
        data, paused = self._state
        return status_text(data, paused, self.size.width or 80)

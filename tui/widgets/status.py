"""The one-line header every view shares: address, backend, device, dtype, models, uptime, state."""

from __future__ import annotations

from rich.text import Text
from textual.widgets import Static

from ..data import DashboardData
from .format import duration


def status_text(data: DashboardData, paused: bool = False) -> Text:
    s = data.stats
    text = Text()
    text.append(" basal-local ", style="bold reverse")
    text.append(f" {data.url} ")
    if not data.connected:
        text.append(" DISCONNECTED ", style="bold white on red")
        text.append(f" retrying: {data.error}", style="red")
    else:
        if s.get("ready"):
            text.append(" ready ", style="bold black on green")
        elif s.get("load_error"):
            text.append(" error ", style="bold white on red")
        else:
            text.append(" loading ", style="bold black on yellow")
        backend = "/".join(x for x in (s.get("backend"), s.get("device"), s.get("dtype")) if x)
        models = ", ".join(m.get("name", "") for m in s.get("models", []))
        text.append(f" {backend or '-'}  {models or '-'}  up {duration(data.uptime())}  v{s.get('version', '?')}")
    if paused:
        text.append("  PAUSED", style="bold yellow")
    return text


class StatusBar(Static):
    DEFAULT_CSS = """
    StatusBar { height: 1; background: $panel; }
    """

    def show(self, data: DashboardData, paused: bool) -> None:
        self.update(status_text(data, paused))

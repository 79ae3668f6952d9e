"""A KPI card: a title in the border, the current value and a sparkline of the last minute."""

from __future__ import annotations

from collections.abc import Sequence

from textual.app import ComposeResult
from textual.containers import Vertical
from textual.widgets import Label, Sparkline


class KpiCard(Vertical):
    DEFAULT_CSS = """
    KpiCard { border: round $primary-darken-1; height: 4; padding: 0 1; }
    KpiCard > Label { width: 1fr; text-style: bold; }
    KpiCard > Sparkline { height: 1; }
    KpiCard.-alert { border: round $error; }
    """

    def __init__(self, title: str, id: str | None = None) -> None:
        super().__init__(id=id)
        self.border_title = title
        self._value: str | None = None
        self._series: list[float] | None = None

    def compose(self) -> ComposeResult:
        yield Label("-", classes="value")
        yield Sparkline([])

    def show(self, value: str, series: Sequence[float] | None = None, alert: bool = False) -> None:
        if value != self._value:
            self._value = value
            self.query_one(Label).update(value)
        if series is not None and list(series) != self._series:
            self._series = list(series)
            self.query_one(Sparkline).data = self._series
        self.set_class(alert, "-alert")

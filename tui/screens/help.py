"""`?`: what every key does."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Static

HELP = """\
[b]basal-local top[/b]: a live view of a basal-local daemon

[b]1[/b] overview   KPIs, queue per model and lane, memory
[b]2[/b] requests   every recent request; [b]Enter[/b] opens one
[b]3[/b] batches    the last batches as prefix trees
[b]4[/b] models     models, engine settings, calibration, device
[b]5[/b] log        the daemon's log

[b]/[/b]  filter requests (words; [b]>200[/b] = slower than 200 ms)
[b]s[/b]  sort requests (time, queue, compute, status, model, client)
[b]p[/b]  pause / resume the display (data keeps coming)
[b]c[/b]  clear stats: errors, 4xx and 529 counts, rates, sparklines, latency
   percentiles, finished requests, past batches and the batch-size
   histogram start over here (the daemon's own counters are untouched)
[b]l f a[/b] log view: cycle the lowest level shown; follow / hold the tail;
   show the access log (one line per finished request)
[b]+ -[/b] refresh faster / slower
[b]Esc[/b] back / clear the filter      [b]q[/b] quit

Rates are per second over the last 5 s; sparklines show the last minute.
Counters add up: received = answered + failed + rejected + 529 + cancelled + in flight."""


class HelpScreen(ModalScreen):
    BINDINGS = [Binding("escape", "dismiss", "Back"), Binding("question_mark", "dismiss", "Back", show=False),
                Binding("q", "dismiss", "Back", show=False)]
    DEFAULT_CSS = """
    HelpScreen { align: center middle; }
    HelpScreen > VerticalScroll { width: 76; max-width: 100%; height: auto; max-height: 100%;
                                  border: round $accent; padding: 0 1; background: $surface; }
    """

    def __init__(self, owns_daemon: bool = False) -> None:
        super().__init__()
        self.owns_daemon = owns_daemon

    def compose(self) -> ComposeResult:
        text = HELP
        if self.owns_daemon:
            text = text.replace("[b]q[/b] quit", "[b]q[/b] quit: stops the daemon too (serve --tui)")
        with VerticalScroll() as box:
            box.border_title = "keys"
            yield Static(text)

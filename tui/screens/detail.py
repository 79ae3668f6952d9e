"""The request detail (Enter on a request): timings, questions, answers with probability bars, confidence."""

from __future__ import annotations

from typing import Any

from rich.console import Group
from rich.table import Table
from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Static

from ..data import client_name
from ..widgets.format import clock, ms, probability_bar


def answer_probabilities(question: dict[str, Any], answer: dict[str, Any]) -> list[tuple[str, float]]:
    """(option, probability) in criteria order; a System One noul answer carries only p(yes)."""
    probabilities = answer.get("probabilities")
    if probabilities:
        return [(str(k), float(v)) for k, v in probabilities.items()]
    if "noul" in answer:
        p = float(answer["noul"])
        return [("yes", p), ("no", 1.0 - p)]
    return []


def confidence_text(confidence: float | None, thresholds: dict[str, float]) -> Text:
    """The answer's confidence against CALIBRATION.json's certified thresholds (error rate -> confidence)."""
    if confidence is None:
        return Text("")
    text = Text(f"confidence {confidence:.3f}")
    if not thresholds:
        return text.append("  (no calibration thresholds for this model)", style="dim")
    for key, needed in sorted(thresholds.items(), key=lambda kv: float(kv[0])):
        ok = confidence >= needed
        mark = "\u2713" if ok else "\u2717"
        text.append(f"  {mark} {float(key) * 100:g} % error needs {needed:.3f}",
                    style="green" if ok else "dim")
    return text


def detail_renderable(record: dict[str, Any], thresholds: dict[str, float]) -> Group:
    head = Table.grid(padding=(0, 2))
    head.add_column(style="bold")
    head.add_column()
    head.add_row("request", str(record.get("id")))
    head.add_row("status", str(record.get("status", "-")) + (f"  {record['error']}" if record.get("error") else ""))
    head.add_row("model / client", f"{record.get('model', '-')} via {record.get('endpoint', '-')}, "
                                   f"{client_name(record.get('client', ''))} at {clock(record.get('ts'))}")
    cached = record.get("cached_tokens")
    head.add_row("tokens", f"{record.get('input_tokens', '-')} input, {record.get('packed_tokens', '-')} packed"
                 + (f", {cached:,} continued from the state cache" if isinstance(cached, int) and cached else ""))
    head.add_row("timings ms", f"planning {ms(record.get('planning_ms'))}, queue {ms(record.get('queue_ms'))}, "
                               f"compute {ms(record.get('compute_ms'))}, total {ms(record.get('total_ms'))}")
    head.add_row("batch", f"{record.get('batch_id', '-')} ({record.get('batch_requests', '-')} requests)")
    parts: list = [head, Text("")]
    answers = record.get("answers") or {}
    for question in record.get("asked") or []:
        qid = question.get("id")
        answer = answers.get(qid, {})
        title = Text(f"{qid} ", style="bold")
        title.append(f"({question.get('type')}) ", style="cyan")
        title.append(str(question.get("instructions", "")))
        parts.append(title)
        labels = {k: t for k, t in question.get("options", [])}
        bars = Table.grid(padding=(0, 1))
        chosen = answer.get("choice")
        for option, p in answer_probabilities(question, answer):
            label = labels.get(option, option)
            mark = "\u25b6" if option == chosen else " "
            bars.add_row(Text(f"{mark} {str(label)[:24]}"), probability_bar(p, 20), Text(f"{p * 100:5.1f} %"))
        parts.append(bars)
        extra = []
        if "score" in answer:
            extra.append(f"score {answer['score']:.3f}")
        conf = answer.get("confidence")
        if conf is None and "noul" in answer:
            conf = max(float(answer["noul"]), 1 - float(answer["noul"]))
        line = Text("  " + "  ".join(extra))
        line.append_text(confidence_text(conf, thresholds))
        parts += [line, Text("")]
    if not record.get("asked"):
        parts.append(Text("the daemon no longer has this request's questions and answers (only answered "
                          "requests of the recent history are kept)", style="dim"))
    return Group(*parts)


class RequestDetailScreen(ModalScreen):
    BINDINGS = [Binding("escape", "dismiss", "Back"), Binding("q", "dismiss", "Back", show=False)]
    DEFAULT_CSS = """
    RequestDetailScreen { align: center middle; }
    RequestDetailScreen > VerticalScroll { width: 96%; height: 92%; border: round $accent; padding: 0 1;
                                           background: $surface; }
    """

    def __init__(self, record: dict[str, Any], thresholds: dict[str, float]) -> None:
        super().__init__()
        self.record = record
        self.thresholds = thresholds

    def compose(self) -> ComposeResult:
        with VerticalScroll() as box:
            box.border_title = f"request {self.record.get('id')}"
            box.border_subtitle = "Esc back"
            yield Static(detail_renderable(self.record, self.thresholds), id="detail")

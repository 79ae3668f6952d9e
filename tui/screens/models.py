"""View 4: the served models, their engine settings and calibration, the device and the limits."""

from __future__ import annotations

from rich.console import Group
from rich.table import Table
from rich.text import Text
from textual.app import ComposeResult
from textual.containers import VerticalScroll
from textual.widgets import Static

from ..data import DashboardData
from ..widgets.device import device_renderable
from ..widgets.format import size
from .base import DashboardScreen


def models_renderable(data: DashboardData) -> Group:
    s = data.stats
    parts: list = []
    device = Table.grid(padding=(0, 2))
    device.add_column(style="bold")
    device.add_column()
    device.add_row("backend", f"{s.get('backend') or '-'} on {s.get('device') or '-'} ({s.get('dtype') or '-'})")
    for key, value in sorted((s.get("memory") or {}).items()):
        device.add_row(key.replace("_bytes", "").replace("_", " "), size(value))
    limits = s.get("limits") or {}
    device.add_row("in-flight limit", str(limits.get("max_inflight", "-")))
    device.add_row("body limit", size(limits.get("max_body_bytes")))
    device.add_row("dashboards attached", str(s.get("subscribers", "-")))
    parts += [Text("device", style="bold underline"), device, Text("")]
    if data.device:
        parts += [Text("device now", style="bold underline"),
                  device_renderable(data.device, s.get("memory") or {}), Text("")]
    for m in s.get("models", []):
        t = Table.grid(padding=(0, 2))
        t.add_column(style="bold")
        t.add_column()
        t.add_row("path", str(m.get("path")))
        t.add_row("layers / hidden / vocab", f"{m.get('layers')} / {m.get('hidden_size')} / {m.get('vocab_size')}")
        if m.get("format"):
            t.add_row("format", str(m["format"]))
        t.add_row("context", f"{m.get('max_positions'):,} tokens" if m.get("max_positions") else "-")
        engine = m.get("engine") or {}
        t.add_row("batching", f"{engine.get('max_batch_tokens')} tokens/batch, {engine.get('schedule')}, "
                              f"long lane > {engine.get('long_tokens')} tokens")
        t.add_row("prefix cache", "on" if engine.get("prefix_cache") else "off")
        replicas = [r for r in s.get("replicas") or [] if r.get("model") == m.get("name")]
        if len(replicas) > 1 or any(not r.get("alive", True) for r in replicas):  # a dead worker restarting
            shown = Text()
            for i, r in enumerate(replicas):
                state = r.get("state") or ("ready" if r.get("alive") else "down")
                shown.append(", " if i else "")
                shown.append(f"{r.get('replica')} on {r.get('device')} ")
                shown.append(state, style="green" if state == "ready" else "bold red")
                if r.get("restarts"):
                    shown.append(f" (restarts {r['restarts']})")
            t.add_row("replicas", shown)
        cal = m.get("calibration") or {}
        temps = ", ".join(f"{k} {v:.3f}" for k, v in (cal.get("temperatures") or {}).items()) or "none"
        thresholds = ", ".join(f"{float(k) * 100:g} % error: {v:.3f}" for k, v in
                               (cal.get("thresholds") or {}).items()) or "none"
        if cal.get("file"):
            t.add_row("calibration file", str(cal["file"]))
        t.add_row("temperatures", temps)
        t.add_row("thresholds", thresholds)
        title = f"{m.get('name')}" + ("  (default)" if m.get("default") else "")
        parts += [Text(title, style="bold underline"), t, Text("")]
    if not s.get("models"):
        parts.append(Text("no model loaded yet"))
    return Group(*parts)


class ModelsScreen(DashboardScreen):
    def body(self) -> ComposeResult:
        with VerticalScroll():
            yield Static(id="models")

    def refresh_data(self, data: DashboardData) -> None:
        self.query_one("#models", Static).update(models_renderable(data))

"""View 4: the served models, their engine settings, state cache, calibration and keep-alive; the models the
daemon knows but does not serve (loading, unloading, unloaded, failed); below them the device and the limits."""

from __future__ import annotations

from typing import Any

from rich.console import Group
from rich.table import Table
from rich.text import Text
from textual.app import ComposeResult
from textual.containers import VerticalScroll
from textual.widgets import Static

from ..data import DashboardData
from ..widgets.cache import hit_rate, memory_text, percent
from ..widgets.device import device_renderable
from ..widgets.format import count, size
from .base import DashboardScreen

STATUS_STYLE = {"loading": "bold black on yellow", "unloading": "bold black on yellow", "unloaded": "bold",
                "failed": "bold white on red"}
NOT_SERVED = {"loading": "loading", "unloading": "unloading", "unloaded": "not loaded: a request for it loads it",
              "failed": "failed to load"}


def cache_setting(engine: dict[str, Any]) -> str:
    """The engine's prefix cache setting as the daemon names it ("auto", "8GB", "40%", "off"); an older daemon
    sends a bool (the template cache on or off)."""
    value = engine.get("prefix_cache")
    if isinstance(value, bool):
        return "on (the chat template only)" if value else "off"
    return str(value) if value not in (None, "") else "-"


def cache_summary(cache: dict[str, Any], short: bool = False) -> str:
    """`6.0/12.0 GiB, 37 nodes, 48.2k tokens; hits 412/562 (73 %), 1.2M tokens continued, 9 evicted` (`short`:
    without the tokens, for a replica's line)."""
    if not cache.get("enabled"):
        return "off"
    lookups = int(cache.get("hits", 0) or 0) + int(cache.get("misses", 0) or 0)
    tokens = "" if short else f", {count(cache.get('tokens'))} tokens"
    continued = "" if short else f", {count(cache.get('hit_tokens'))} tokens continued"
    return (f"{memory_text(cache)}, {count(cache.get('nodes'))} nodes{tokens}; hits {count(cache.get('hits'))}/"
            f"{count(lookups)} ({percent(hit_rate(cache))}){continued}, {count(cache.get('evictions'))} evicted")


def models_renderable(data: DashboardData) -> Group:
    s = data.stats
    states = {str(e["name"]): e for e in data.model_states()}
    parts: list = []
    for m in s.get("models", []):
        t = Table.grid(padding=(0, 2))
        t.add_column(style="bold")
        t.add_column()
        t.add_row("path", str(m.get("path")))
        t.add_row("layers / hidden / vocab", f"{m.get('layers')} / {m.get('hidden_size')} / {m.get('vocab_size')}")
        port = m.get("port") or {}  # model/formats.py port_summary: the format and the calibration file in use
        if port.get("format") or m.get("format"):
            bits = f", {port['bits']}-bit" if port.get("bits") else ""
            t.add_row("format", f"{port.get('format') or m.get('format')}{bits}")
        t.add_row("context", f"{m.get('max_positions'):,} tokens" if m.get("max_positions") else "-")
        engine = m.get("engine") or {}
        t.add_row("batching", f"{engine.get('max_batch_tokens')} tokens/batch, {engine.get('schedule')}, "
                              f"long lane > {engine.get('long_tokens')} tokens")
        t.add_row("state cache", f"setting {cache_setting(engine)}")
        if isinstance(m.get("prefix_cache"), dict):
            t.add_row("", cache_summary(m["prefix_cache"]))
        replicas = m.get("replicas") or []
        if len(replicas) > 1 or any(r.get("state", "ready") != "ready" for r in replicas):  # a worker restarting
            for r in replicas:
                state = r.get("state") or ("ready" if r.get("alive", True) else "down")
                shown = "" if state == "ready" else f"  ({state}" + (
                    f", restarts {r['restarts']})" if r.get("restarts") else ")")
                cache = r.get("prefix_cache")
                t.add_row(f"replica {r.get('replica')}", f"{r.get('device', '-')}{shown}" +
                          (f": cache {cache_summary(cache, short=True)}" if isinstance(cache, dict) else ""))
        cal = m.get("calibration") or {}
        temps = ", ".join(f"{k} {v:.3f}" for k, v in (cal.get("temperatures") or {}).items()) or "none"
        thresholds = ", ".join(f"{float(k) * 100:g} % error: {v:.3f}" for k, v in
                               (cal.get("thresholds") or {}).items()) or "none"
        cal_file = port.get("calibration_file") or cal.get("file")
        if cal_file:
            inherited = "  (inherited: the port ships none of its own)" if port.get("calibration_inherited") else ""
            t.add_row("calibration file", f"{cal_file}{inherited}")
        t.add_row("temperatures", temps)
        t.add_row("thresholds", thresholds)
        state = states.get(str(m.get("name"))) or {}
        if state:
            t.add_row("keep alive", keep_alive(state))
        parts += [model_title(m, state.get("status")), t, Text("")]
    served = {str(m.get("name")) for m in s.get("models", [])}
    for name, state in states.items():  # known, not served: loading, unloading, unloaded or failed
        if name not in served:
            t = Table.grid(padding=(0, 2))
            t.add_column(style="bold")
            t.add_column()
            if state.get("path"):
                t.add_row("path", str(state["path"]))
            t.add_row("status", NOT_SERVED.get(str(state.get("status")), str(state.get("status", "-"))))
            if state.get("error"):
                t.add_row("error", Text(str(state["error"]), style="red"))
            parts += [model_title({"name": name, "default": state.get("default")}, state.get("status")), t, Text("")]
    if not s.get("models") and not states:
        parts += [Text("no model loaded yet"), Text("")]
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
                  device_renderable(data.device, s.get("memory") or {}, replicas=data.replicas(), tall=True), Text("")]
    return Group(*parts)


def model_title(m: dict[str, Any], status: str | None) -> Text:
    title = Text(str(m.get("name")), style="bold underline")
    if m.get("default"):
        title.append("  (default)", style="bold")
    if status and status != "loaded":
        title.append("  ").append(f" {status} ", style=STATUS_STYLE.get(status, "bold"))
    return title


def keep_alive(state: dict[str, Any]) -> str:
    """`300 s (unloads in 120 s without a request)`, or `for ever`: how long the daemon keeps the model idle."""
    keep = state.get("keep_alive_s")
    if keep is None:
        return "for ever (no keep-alive)"
    text = f"{keep:g} s"
    if isinstance(state.get("expires_in_s"), int | float):
        text += f" (unloads in {state['expires_in_s']:g} s without a request)"
    return text


class ModelsScreen(DashboardScreen):
    def body(self) -> ComposeResult:
        with VerticalScroll():
            yield Static(id="models")

    def refresh_data(self, data: DashboardData) -> None:
        self.query_one("#models", Static).update(models_renderable(data))

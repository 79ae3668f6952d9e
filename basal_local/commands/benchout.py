"""How `basal-local bench` shows its figures: a rich table on a terminal (nested figures as dotted names), the
same result as one JSON object with --json; its progress lines on stderr; the percentile rule of its figures."""

from __future__ import annotations

import json
import sys
import time
from typing import Any

from rich.console import Console
from rich.table import Table


def flatten(result: dict[str, Any], prefix: str = "") -> list[tuple[str, str]]:
    """(dotted name, value) rows; dicts open into their keys, lists of dicts into numbered entries (`bench
    --cache`'s per_document.1.cached_second_ms), other lists and leaves print as they are."""
    rows: list[tuple[str, str]] = []
    for key, value in result.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            rows += flatten(value, name + ".")
        elif isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
            for i, item in enumerate(value, 1):
                rows += flatten(item, f"{name}.{i}.")
        else:
            rows.append((name, value if isinstance(value, str) else json.dumps(value)))
    return rows


def print_result(result: dict[str, Any], as_json: bool) -> None:
    if as_json:
        print(json.dumps(result))
        return
    table = Table(title=f"basal-local bench ({result.get('mode', '')})", title_justify="left")
    table.add_column("figure", style="bold", overflow="fold")  # a long name folds rather than losing its end
    table.add_column("value", overflow="fold")
    for name, value in flatten(result):
        table.add_row(name, value)
    Console(file=sys.stdout, soft_wrap=False).print(table)


def http_failure(result: dict[str, Any]) -> str | None:
    """The sentence for a bench --http that must end non-zero (the daemon went away, requests failed)."""
    failed = result.get("errors", 0)
    if result.get("daemon_gone"):
        return f"the daemon at {result.get('url')} went away during the bench ({failed} requests failed)"
    if failed or result.get("error"):
        reasons = ", ".join(f"{n} x {r}" for r, n in (result.get("errors_by_reason") or {}).items())
        return f"{failed} requests failed" + (f": {reasons}" if reasons else "")
    return None


def percentile(values: list[float], q: float) -> float:
    """The nearest-rank percentile (q in 0..1) of the values."""
    ordered = sorted(values)
    rank = max(0, min(len(ordered) - 1, int(round(q * len(ordered) + 0.5)) - 1))
    return ordered[rank]


def phase(text: str) -> None:
    """Progress of a long measurement, on stderr (stdout stays the result, --json included)."""
    print(f"basal-local bench: {text}...", file=sys.stderr, flush=True)


class Ticker:
    """Progress inside a long step: `done/total` and the time left, on stderr, at most every `every_s`."""

    def __init__(self, label: str, total: int, every_s: float = 5.0, clock=time.perf_counter) -> None:
        self.label, self.total, self.every_s, self.clock = label, total, every_s, clock
        self.done, self.started = 0, clock()
        self.last = self.started

    def step(self) -> str | None:
        """Count the item about to start; the line printed, if one was due."""
        now = self.clock()
        line = None
        if self.done and now - self.last >= self.every_s:
            left = (now - self.started) / self.done * (self.total - self.done)
            line = f"{self.label} {self.done}/{self.total}, about {left:.0f} s left"
            phase(line)
            self.last = now
        self.done += 1
        return line


def answer_timings(headers) -> tuple[float | None, float | None]:
    """(queue ms, compute ms) of a decision as the daemon timed it (x-basal-queue-ms, x-basal-compute-ms)."""
    queue, compute = (headers.get(f"x-basal-{h}-ms") for h in ("queue", "compute"))
    return (float(queue) if queue else None), (float(compute) if compute else None)

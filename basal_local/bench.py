"""What `basal-local bench` and the measuring tools share: the sample set as single-question requests, the
percentile rule, the progress lines on stderr. The command itself is `commands/bench.py`: in process through the
engine (`commands/benchengine.py`), over HTTP (`commands/benchhttp.py`), beside transformers
(`commands/benchhf.py`), shown by `commands/benchout.py`.
"""

from __future__ import annotations

import sys
import time
from typing import Any

from .samples import sample_requests

__all__ = ["Ticker", "percentile", "phase", "sample_requests", "single_question_requests"]


def single_question_requests(model: str) -> list[dict[str, Any]]:
    """Each question of the sample set as its own System One request."""
    out = []
    for item in sample_requests():
        for qid, q in item["questions"].items():
            out.append({"model": model, "state": item["state"], "questions": {qid: q}})
    return out


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

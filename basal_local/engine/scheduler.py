"""Queue order and batch formation (ENGINE.md §3): HRRN or FIFO, trie-growth budget per batch."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from .packer import PrefixTrie, PromptSpec

RATE_START = 3000.0  # tokens/s before anything was measured
MAX_REJECTIONS = 64  # stop scanning the queue for batch-mates after this many misfits


class Cancelled(Exception):
    """The client went away before its request was computed."""


@dataclass
class Job:
    plan: Any  # RequestPlan (kept loose so schedulers can be tested with stand-ins)
    tokens: int
    specs: Sequence[PromptSpec]
    future: Future = field(default_factory=Future)
    is_cancelled: Callable[[], bool] = lambda: False
    arrival: float = field(default_factory=time.perf_counter)
    request_id: str = ""


def hrrn_order(jobs: list[Job], now: float, rate: float) -> list[Job]:
    """Highest response ratio first: (wait + est) / est with est = tokens / rate. Stable for ties."""
    return sorted(jobs, key=lambda j: -(now - j.arrival) * rate / max(j.tokens, 1))


class BatchSizer:
    """Measures how many packed tokens a batch of jobs needs (prompts of all jobs in shared tries)."""

    def __init__(self, prefixes: dict[str, Sequence[int]]) -> None:
        self.prefixes = prefixes
        self.tries: dict[str, PrefixTrie] = {}
        self.tokens = 0

    def _key_ids(self, spec: PromptSpec) -> tuple[str, list[int]]:
        ids = list(spec.token_ids)
        cached = self.prefixes.get(spec.lang)
        if cached is not None and len(ids) > len(cached) and ids[: len(cached)] == list(cached):
            return spec.lang, ids[len(cached):]
        return spec.lang + "/full", ids

    def add(self, job: Job) -> int:
        added = 0
        for spec in job.specs:
            key, ids = self._key_ids(spec)
            added += self.tries.setdefault(key, PrefixTrie()).insert(ids, 0)
        self.tokens += added
        return added


def form_batch(queue: list[Job], max_batch_tokens: int, prefixes: dict[str, Sequence[int]],
               schedule: str, rate: float, now: float | None = None) -> tuple[list[Job], list[Job]]:
    """Take the first job in queue order and each later one whose trie growth still fits the budget.

    Returns (batch, rest); the rest keeps its order. A job larger than the budget runs alone.
    """
    now = time.perf_counter() if now is None else now
    ordered = hrrn_order(queue, now, rate) if schedule == "hrrn" else list(queue)
    if not ordered:
        return [], []
    batch = [ordered[0]]
    sizer = BatchSizer(prefixes)
    sizer.add(ordered[0])
    rest: list[Job] = []
    rejections = 0
    for job in ordered[1:]:
        if rejections >= MAX_REJECTIONS or sizer.tokens >= max_batch_tokens:
            rest.append(job)
            continue
        if sizer.tokens + job.tokens <= max_batch_tokens:
            sizer.add(job)
            batch.append(job)
            continue
        # its own size does not fit; shared prefixes with the batch may still make it fit
        trial = BatchSizer(prefixes)
        for member in batch:
            trial.add(member)
        trial.add(job)
        if trial.tokens <= max_batch_tokens:
            sizer = trial
            batch.append(job)
        else:
            rejections += 1
            rest.append(job)
    return batch, rest

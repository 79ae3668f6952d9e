"""What the engine answers for one request, before any wire dialect: per question the calibrated probabilities
and the fields its type needs, the request's token counts and its timings.

`api/answers.py` turns an Outcome into the body of `/v1/systemone` or `/v1/basal`. Outcomes cross between
processes (replica workers), so they hold plain data only.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class QuestionOutcome:
    qtype: str  # noul | score | choice | multi | act
    keys: list[str]
    p_cal: list[float] = field(default_factory=list)  # calibrated, criteria order (noul, score, choice)
    legend: Any = None  # a score's legend, echoed
    fixed: bool = False  # a single-option question (answered without the model)
    fields: dict[str, Any] | None = None  # multi and act: their answer object, the same in both dialects
    evidence: list[dict[str, Any]] | None = None  # the spans, when the question asked for them


@dataclass
class Outcome:
    model: str
    answers: dict[str, QuestionOutcome]  # in the request's question order
    input_tokens: int  # every prompt of every round
    packed_tokens: int = 0  # the last round's packed tokens
    planning_ms: float = 0.0  # every round's planning
    queue_ms: float = 0.0  # summed over the rounds
    compute_ms: float = 0.0
    batch_requests: int = 1  # the last round's batch
    batch_id: int = 0
    cached_tokens: int = 0  # the last round's tokens per prompt read from cached K/V (x-basal-cached-tokens)
    refused: tuple[str, str] | None = None  # (question id, why): an act `max_error` without a defer action

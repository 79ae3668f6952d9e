"""Answer bodies of both dialects (PROTOCOL.md §3) and the `usage` block (§1.4), from the engine's Outcome.

The engine answers without a dialect (protocol/outcome.py); what differs between `/v1/systemone` and `/v1/basal`
(the noul shape, what `confidence` means, how a single-option question counts) is decided here.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ..protocol.decision import argmax_first, choice_confidence, score_confidence, score_value
from ..protocol.outcome import Outcome, QuestionOutcome


def answer(q: QuestionOutcome, dialect: str) -> dict[str, Any]:
    """The answer object of one question: multi and act as the engine computed them, the others from p_cal."""
    if q.fields is not None:
        return dict(q.fields)
    p_cal = q.p_cal
    probabilities = dict(zip(q.keys, p_cal))
    if q.qtype == "noul":
        if dialect == "systemone":
            return {"type": "noul", "noul": p_cal[0]}
        return {"type": "noul", "noul": p_cal[0], "probabilities": probabilities, "confidence": max(p_cal)}
    if q.qtype == "score":
        confidence = score_confidence(p_cal) if dialect == "systemone" else max(p_cal)
        return {"type": "score", "score": score_value(p_cal), "legend": q.legend, "probabilities": probabilities,
                "confidence": confidence}
    confidence = choice_confidence(p_cal) if dialect == "systemone" else max(p_cal)
    return {"type": "choice", "choice": q.keys[argmax_first(p_cal)], "probabilities": probabilities,
            "confidence": confidence}


def branches_of(q: QuestionOutcome, dialect: str) -> int:
    """§1.4: a multi counts its labels, a single-option question 0 (TypeSafe dialect), anything else 1."""
    if q.qtype == "multi":
        return len(q.keys)
    return 0 if (q.fixed and dialect == "systemone") else 1


def usage(input_tokens: int, questions: Sequence[QuestionOutcome], latency_ms: float, dialect: str) -> dict[str, Any]:
    branches = sum(branches_of(q, dialect) for q in questions)
    return {"input_tokens": input_tokens, "output_tokens": 0, "questions": len(questions), "branches": branches,
            "latency_ms": round(latency_ms, 2)}


def response_body(outcome: Outcome, dialect: str, latency_ms: float) -> dict[str, Any]:
    """The 200 body of a decision request."""
    answers = {}
    for qid, q in outcome.answers.items():
        answers[qid] = answer(q, dialect)
        if q.evidence is not None:
            answers[qid]["evidence"] = q.evidence
    return {"model": outcome.model, "answers": answers,
            "usage": usage(outcome.input_tokens, list(outcome.answers.values()), latency_ms, dialect)}

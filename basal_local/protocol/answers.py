"""Answer objects of both dialects (docs/PROTOCOL.md §3) and the `usage` block (§1.4)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from .decision import argmax_first, choice_confidence, score_confidence, score_value
from .questions import Question


def answer(question: Question, p_cal: Sequence[float], dialect: str) -> dict[str, Any]:
    """The answer object for one question from its calibrated probabilities (criteria order)."""
    probabilities = dict(zip(question.keys, p_cal))
    if question.qtype == "noul":
        if dialect == "systemone":
            return {"type": "noul", "noul": p_cal[0]}
        return {"type": "noul", "noul": p_cal[0], "probabilities": probabilities, "confidence": max(p_cal)}
    if question.qtype == "score":
        confidence = score_confidence(p_cal) if dialect == "systemone" else max(p_cal)
        return {"type": "score", "score": score_value(p_cal), "legend": question.legend,
                "probabilities": probabilities, "confidence": confidence}
    confidence = choice_confidence(p_cal) if dialect == "systemone" else max(p_cal)
    return {"type": "choice", "choice": question.keys[argmax_first(p_cal)], "probabilities": probabilities,
            "confidence": confidence}


def branches_of(question: Question, dialect: str) -> int:
    """§1.4: a multi counts its labels, a single-option question 0 (TypeSafe dialect), anything else 1."""
    if question.qtype == "multi":
        return len(question.keys)
    return 0 if (question.fixed and dialect == "systemone") else 1


def usage(input_tokens: int, questions: Sequence[Question], latency_ms: float, dialect: str) -> dict[str, Any]:
    branches = sum(branches_of(q, dialect) for q in questions)
    return {"input_tokens": input_tokens, "output_tokens": 0, "questions": len(questions), "branches": branches,
            "latency_ms": round(latency_ms, 2)}

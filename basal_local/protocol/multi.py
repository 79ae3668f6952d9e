"""`multi` questions (docs/PROTOCOL.md §6.4): one yes/no branch per label and the selection rule.

Each label becomes an ordinary two-option question (MULTI_Q text, default yes/no options, both orders,
noul temperature); its P(label) is the calibrated probability of "yes". The branches are just more
prompts of the request, so the packer shares their common state in the prefix tree.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from .constants import MULTI_QUESTION, YES_NO
from .multi_objective import OBJECTIVES, Constraints, choose
from .textrule import to_text


@dataclass(frozen=True)
class MultiSpec:
    """Selection parameters; `max_count`/`min_count` are already truncated toward zero (None = not given).

    `objective`, `exclusive`, `fallback` and `fallback_threshold` are the basal dialect's selection options
    (protocol/multi_objective.py); their defaults give the plain threshold rule and its answer shape."""

    threshold: float = 0.5
    max_count: int | None = None
    min_count: int | None = None
    objective: str = "threshold"
    exclusive: tuple[str, ...] = ()
    fallback: str | None = None
    fallback_threshold: float | None = None

    @property
    def plain(self) -> bool:
        """The §6.4 rule alone (the answer keeps exactly its original fields)."""
        return self.objective == "threshold" and not self.exclusive and self.fallback is None


def labels_of(criteria: Any) -> tuple[list[str], list[str]] | None:
    """(keys, label texts) of an object (text = description, or the key when null) or an array of strings.

    Duplicate strings of an array collapse (first position wins). None when criteria has neither form.
    """
    if isinstance(criteria, dict):
        return list(criteria), [key if desc is None else to_text(desc) for key, desc in criteria.items()]
    if isinstance(criteria, list):
        keys = list(dict.fromkeys(to_text(item) for item in criteria))
        return keys, list(keys)
    return None


def selection_options(q: dict, keys: Sequence[str]) -> dict[str, Any]:
    """`objective`, `exclusive`, `fallback`, `fallback_threshold` of a basal multi question, checked; raises
    ValueError with the field's name (the caller adds the question id)."""
    out: dict[str, Any] = {}
    objective = q.get("objective", "threshold")
    if objective is None:
        objective = "threshold"
    if objective not in OBJECTIVES:
        raise ValueError(f"objective must be one of {', '.join(OBJECTIVES)}, got {to_text(objective)}")
    if objective != "threshold" and q.get("threshold") is not None:
        raise ValueError(f"threshold applies only to objective threshold, not {objective}")
    out["objective"] = objective
    exclusive = q.get("exclusive")
    if exclusive is not None:
        if not isinstance(exclusive, list) or not all(isinstance(k, str) for k in exclusive):
            raise ValueError("exclusive must be an array of label keys")
        unknown = [k for k in exclusive if k not in keys]
        if unknown:
            raise ValueError(f"exclusive names an unknown label: {unknown[0]}")
        out["exclusive"] = tuple(dict.fromkeys(exclusive))
    fallback = q.get("fallback")
    if fallback is not None:
        if not isinstance(fallback, str) or fallback not in keys:
            raise ValueError(f"fallback must be one of the labels, got {to_text(fallback)}")
        out["fallback"] = fallback
    level = q.get("fallback_threshold")
    if level is not None:
        if fallback is None:
            raise ValueError("fallback_threshold requires fallback")
        if isinstance(level, bool) or not isinstance(level, (int, float)) or not 0 <= level <= 1:
            raise ValueError(f"fallback_threshold must be a number from 0 to 1, got {to_text(level)}")
        out["fallback_threshold"] = float(level)
    return out


def truncate_count(value: Any) -> int | None:
    """`max`/`min`: a number truncated toward zero (a bool or non-number is the caller's error)."""
    if value is None:
        return None
    return math.trunc(value)


def branch_question(lang: str, instructions_text: str, label_text: str) -> str:
    """MULTI_Q of the request language; the values are inserted verbatim (never re-scanned)."""
    return MULTI_QUESTION[lang].format(instructions=instructions_text, label=label_text)


def branch_options(lang: str) -> tuple[str, str]:
    return YES_NO[lang]


def select(keys: Sequence[str], probabilities: Sequence[float], spec: MultiSpec) -> tuple[list[str], float]:
    """(selected keys in descending-P order, set confidence) by the §6.4 rule.

    Labels are ordered by P descending (stable: ties keep criteria order); those with P >= threshold are
    selected, cut to `max` (negative counts as 0), then topped up to `min` from the ordering.
    """
    order = sorted(range(len(keys)), key=lambda i: -probabilities[i])
    chosen = [i for i in order if probabilities[i] >= spec.threshold]
    if spec.max_count is not None:
        chosen = chosen[: max(spec.max_count, 0)]
    if spec.min_count is not None and len(chosen) < spec.min_count:
        chosen = order[: spec.min_count]
    picked = set(chosen)
    confidence = 1.0
    for i, p in enumerate(probabilities):
        confidence *= p if i in picked else 1.0 - p
    return [keys[i] for i in chosen], confidence


def multi_answer(keys: Sequence[str], probabilities: Sequence[float], spec: MultiSpec) -> dict[str, Any]:
    if spec.plain:
        selected, confidence = select(keys, probabilities, spec)
        return {"type": "multi", "selected": selected, "probabilities": dict(zip(keys, probabilities)),
                "threshold": float(spec.threshold), "set_confidence": confidence}
    constraints = Constraints(spec.min_count, spec.max_count, spec.exclusive, spec.fallback, spec.fallback_threshold)
    chosen = choose(keys, probabilities, spec.objective, constraints, spec.threshold)
    answer: dict[str, Any] = {"type": "multi", "selected": chosen.selected,
                              "probabilities": dict(zip(keys, probabilities)), "objective": spec.objective}
    if spec.objective == "threshold":
        answer["threshold"] = float(spec.threshold)
    else:
        answer["expected_score"] = chosen.expected_score
    answer["set_confidence"] = chosen.set_confidence
    answer["constraints_applied"] = chosen.constraints_applied
    return answer

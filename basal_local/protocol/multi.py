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
from .textrule import to_text


@dataclass(frozen=True)
class MultiSpec:
    """Selection parameters; `max_count`/`min_count` are already truncated toward zero (None = not given)."""

    threshold: float = 0.5
    max_count: int | None = None
    min_count: int | None = None


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
    selected, confidence = select(keys, probabilities, spec)
    return {"type": "multi", "selected": selected, "probabilities": dict(zip(keys, probabilities)),
            "threshold": float(spec.threshold), "set_confidence": confidence}

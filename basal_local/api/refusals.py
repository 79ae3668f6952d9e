"""Fields and question types that would change an answer but that this runtime cannot honour (both dialects).

Clients send them (jevclient's JSON image `assets`, basal-client's `media`/`lang`, its multi selection fields and
2.1 task types, pydecide's noul `labels`); ignoring one would answer a different question than the one asked, so
each is refused with the System One "unsupported" body naming it (PROTOCOL.md §2.1). Fields that cannot change
an answer stay ignored: docs/WIRE.md lists them. Also the per-request limits on questions and prompts.
"""

from __future__ import annotations

import math
from typing import Any

from ..protocol.constants import MAX_OPTIONS

TEXT_ONLY = "basal models read text only"
# top-level fields: what each would change
TOP_LEVEL = {
    "assets": f"images (assets) are not supported: {TEXT_ONLY}",
    "media": f"media inputs are not supported: {TEXT_ONLY}",
    "lang": "lang is not supported: the prompt language follows the state and instructions (Polish iff they "
            "contain a Polish letter)",
}
# question fields per question type
QUESTION_FIELDS = {
    "multi": {
        "exclusive": "multi exclusive labels are not supported: labels are decided independently",
        "fallback": "multi fallback is not supported: an empty selection stays empty",
        "fallback_threshold": "multi fallback_threshold is not supported: an empty selection stays empty",
        "objective": "multi objective is not supported: labels are selected by threshold (threshold, max, min)",
    },
    "noul": {"labels": 'noul labels are not supported: describe the outcomes in criteria {"true", "false"}'},
}
# types other Basal runtimes or TypeSafe know, which this engine does not have
UNSUPPORTED_TYPES = {
    "tool": "tool calls", "classify": "the 2.1 classify task", "verify": "the 2.1 verify task",
    "compress": "the 2.1 compress task", "extract": "the 2.1 extract task", "box": f"box questions ({TEXT_ONLY})",
}
SUPPORTED_TYPES = "choice, noul, score, multi, act"

# Per request (30.8): far above real use (TypeSafe's own 64k-token budget fits ~250 small questions), far below
# what stalls the daemon (250,000 questions took 29.5 s and 3.5 GB to plan).
MAX_QUESTIONS = 1024
MAX_PROMPTS = 8192


def _given(value: Any) -> bool:
    return value is not None


def top_level_refusal(body: dict) -> tuple[str, list[Any], str] | None:
    for name, why in TOP_LEVEL.items():
        if _given(body.get(name)):
            return "unsupported_feature", ["body", name], why
    return None


def type_refusal(qid: str, qtype: Any) -> tuple[str, list[Any], str] | None:
    if isinstance(qtype, str) and qtype in UNSUPPORTED_TYPES:
        return ("unsupported_feature", ["body", "questions", qid],
                f"question type '{qtype}' ({UNSUPPORTED_TYPES[qtype]}) is not supported by this runtime "
                f"(supported: {SUPPORTED_TYPES})")
    return None


def field_refusal(qid: str, qtype: Any, q: dict) -> tuple[str, list[Any], str] | None:
    for name, why in QUESTION_FIELDS.get(qtype, {}).items():
        if _given(q.get(name)):
            return "unsupported_feature", ["body", "questions", qid, name], why
    return None


def prompts_of(qtype: Any, q: dict) -> int:
    """An upper bound of the prompts a question costs, from its raw fields (before any rendering)."""
    criteria = q.get("criteria")
    if criteria is None and qtype == "score":
        criteria = q.get("levels")
    n = len(criteria) if isinstance(criteria, (dict, list)) else 2
    if qtype == "multi":
        return 2 * n
    if n > MAX_OPTIONS:  # large choice: one-order groups of two partitions, then the final round's two orders
        return 2 * math.ceil(n / MAX_OPTIONS) + 2
    return 2


def count_prompts(questions: dict) -> int:
    return sum(prompts_of(q.get("type"), q) for q in questions.values() if isinstance(q, dict))

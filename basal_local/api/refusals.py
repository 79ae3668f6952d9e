"""Fields and question types that would change an answer but that this runtime cannot honour (both dialects).

Clients send them (jevclient's JSON image `assets`, basal-client's `media`/`lang`, its multi selection fields and
2.1 task types, pydecide's noul `labels`); ignoring one would answer a different question than the one asked, so
each is refused with the System One "unsupported" body naming it (docs/PROTOCOL.md §2.1). Fields that cannot change
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
        "exclusive": "multi exclusive labels are not supported on /v1/systemone (/v1/basal answers them)",
        "fallback": "multi fallback is not supported on /v1/systemone (/v1/basal answers it)",
        "fallback_threshold": "multi fallback_threshold is not supported on /v1/systemone (/v1/basal answers it)",
        "objective": "multi objective is not supported on /v1/systemone (/v1/basal answers it)",
    },
    "noul": {"labels": 'noul labels are not supported: describe the outcomes in criteria {"true", "false"}'},
}
# types other Basal runtimes or TypeSafe know, which this engine does not have
UNSUPPORTED_TYPES = {
    "tool": "tool calls: /v1/basal answers them", "classify": "the 2.1 classify task", "verify": "the 2.1 verify task",
    "compress": "the 2.1 compress task", "extract": "the 2.1 extract task", "box": f"box questions ({TEXT_ONLY})",
}
SUPPORTED_TYPES = {"systemone": "choice, noul, score, multi, act", "basal": "choice, noul, score, multi, act, tool"}
# what `/v1/basal` answers (protocol/tools.py, protocol/multi_objective.py); `/v1/systemone` refuses them
ANSWERED_ON_BASAL = {"tool", "multi"}

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


def type_refusal(qid: str, qtype: Any, dialect: str) -> tuple[str, list[Any], str] | None:
    if not isinstance(qtype, str) or qtype not in UNSUPPORTED_TYPES:
        return None
    if dialect == "basal" and qtype in ANSWERED_ON_BASAL:
        return None
    return ("unsupported_feature", ["body", "questions", qid],
            f"question type '{qtype}' ({UNSUPPORTED_TYPES[qtype]}) is not supported by this runtime "
            f"(supported: {SUPPORTED_TYPES[dialect]})")


def field_refusal(qid: str, qtype: Any, q: dict, dialect: str) -> tuple[str, list[Any], str] | None:
    if not isinstance(qtype, str):  # a list or an object as the type (unhashable): validation names it
        return None
    if dialect == "basal" and qtype in ANSWERED_ON_BASAL:
        return None
    for name, why in QUESTION_FIELDS.get(qtype, {}).items():
        if _given(q.get(name)):
            return "unsupported_feature", ["body", "questions", qid, name], why
    return None


def prompts_of(qtype: Any, q: dict) -> int:
    """An upper bound of the prompts a question costs, from its raw fields (before any rendering)."""
    criteria = q.get("criteria")
    if criteria is None and qtype == "score":
        criteria = q.get("levels")
    if qtype == "tool":  # one option per tool and extra (protocol/tools.py); a multi selection is one branch each
        extra = q.get("extra")
        criteria = [*(q.get("tools") or [] if isinstance(q.get("tools"), (list, dict)) else []),
                    *(extra if isinstance(extra, list) else [])]
        if q.get("multi"):
            return 2 * len(criteria)
    n = len(criteria) if isinstance(criteria, (dict, list)) else 2
    if qtype == "multi":
        return 2 * n
    if n > MAX_OPTIONS:  # large choice: one-order groups of two partitions, then the final round's two orders
        return 2 * math.ceil(n / MAX_OPTIONS) + 2
    return 2


def count_prompts(questions: dict) -> int:
    return sum(prompts_of(q.get("type"), q) for q in questions.values() if isinstance(q, dict))

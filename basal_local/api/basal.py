"""`POST /v1/basal`: the lenient upstream dialect (PROTOCOL.md §8). Every failure is 422 {"error": ...}."""

from __future__ import annotations

from typing import Any

from ..protocol.constants import MAX_OPTIONS
from ..protocol.questions import DecisionRequest, Question
from ..protocol.render import named_option_texts
from ..protocol.textrule import to_text
from .errors import basal_error


def _options(qid: str, q: dict, qtype: str) -> tuple[list[str], list[str], str]:
    """Keys, shown texts and the option_keys mode of a choice/score question."""
    mode = q.get("option_keys") or "show"
    if mode not in ("show", "hide"):
        raise ValueError(f"option_keys must be 'show' or 'hide', got {to_text(mode)}")
    if qtype == "score":
        levels = q.get("criteria") or q.get("levels")
        if isinstance(levels, dict) and levels:
            keys, shown = named_option_texts(levels, mode)
            return keys, shown, mode
        if isinstance(levels, list) and levels:
            return [str(i) for i in range(len(levels))], [to_text(v) for v in levels], mode
        return [], [], mode
    criteria = q.get("criteria")
    if isinstance(criteria, dict) and criteria:
        keys, shown = named_option_texts(criteria, mode)
        return keys, shown, mode
    if isinstance(criteria, list) and criteria:
        named: dict[str, Any] = {}
        for item in criteria:
            named.setdefault(to_text(item), None)
        keys, shown = named_option_texts(named, mode)
        return keys, shown, mode
    return [], [], mode


def _question(qid: str, q: Any) -> Question:
    if not isinstance(q, dict):
        raise ValueError(f"question '{qid}' must be a JSON object")
    raw_type = q.get("type")
    qtype = raw_type if raw_type in ("choice", "noul", "score") else "choice"
    calibration_key = qtype if raw_type in ("choice", "noul", "score") else None
    if raw_type in ("multi", "act"):
        raise ValueError(f"question '{qid}': type {raw_type} is not supported yet by basal-local")
    instructions = to_text(q["instructions"]) if "instructions" in q else ""
    if qtype == "noul":
        criteria = q.get("criteria") if isinstance(q.get("criteria"), dict) else {}
        descs = [criteria.get("true"), criteria.get("false")]
        texts = tuple(to_text(d) if d else "" for d in descs)
        return Question(qid, "noul", instructions, ("true", "false"), texts, "noul",
                        default_yes_no=(not descs[0], not descs[1]))
    keys, shown, _ = _options(qid, q, qtype)
    if not 2 <= len(keys) <= MAX_OPTIONS:
        raise ValueError(f"question '{qid}': {len(keys)} options (supported: 2..{MAX_OPTIONS})")
    legend = dict(zip(keys, shown)) if qtype == "score" else None
    return Question(qid, qtype, instructions, tuple(keys), tuple(shown), calibration_key, legend=legend)


def validate_basal(body: Any, model_name: str) -> DecisionRequest:
    """Validate a parsed body for the routed model; raises ApiError(422, {"error": ...})."""
    if not isinstance(body, dict):
        raise basal_error("request body must be a JSON object")
    if body.get("state") is None:
        raise basal_error("'state'")
    questions = body.get("questions")
    if not isinstance(questions, dict):
        raise basal_error("'questions' must be a JSON object")
    messages: list[str] = []
    parsed: list[Question] = []
    for qid, q in questions.items():
        try:
            parsed.append(_question(qid, q))
        except ValueError as exc:
            messages.append(str(exc))
    if messages:
        raise basal_error("; ".join(messages))
    return DecisionRequest("basal", model_name, to_text(body["state"]), parsed)


def route_basal(body: Any, served: dict[str, Any], default: str) -> str:
    if isinstance(body, dict) and isinstance(body.get("model"), str):
        if body["model"] not in served:
            raise basal_error(f"Unknown model: {body['model']} (served: {', '.join(served)})")
        return body["model"]
    return default

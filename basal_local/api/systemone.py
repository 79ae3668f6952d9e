"""`POST /v1/systemone`: the strict TypeSafe dialect (PROTOCOL.md §2, §2.1, §3).

All schema errors (422) of a request are collected into one `detail` list; usage errors (400) are
reported only when there is no schema error, and only the first; "unsupported" errors (422) come last,
for requests that are valid but that this runtime cannot answer.
"""

from __future__ import annotations

from typing import Any

from ..protocol.constants import MAX_CHOICES, MAX_OPTIONS, MAX_SCORE_LEVELS
from ..protocol.questions import DecisionRequest, Question
from ..protocol.render import named_option_texts
from ..protocol.textrule import is_text_value, to_text
from .errors import (
    MSG_NOT_OBJECT,
    ApiError,
    field_error,
    missing,
    union_errors,
    unsupported,
    usage_error,
    validation_error,
)

KNOWN_TYPES = ("choice", "noul", "score")
EXTENSION_TYPES = ("multi", "act")


class _Collector:
    def __init__(self) -> None:
        self.schema: list[dict] = []
        self.usage: list[str] = []
        self.unsupported: list[tuple[str, list[Any], str]] = []


def _check_text(value: Any, loc: list[Any], out: _Collector) -> None:
    if value is not None and not is_text_value(value):
        out.schema.extend(union_errors(loc, value))


def _option_keys(q: dict, loc: list[Any], out: _Collector) -> str:
    mode = q.get("option_keys")
    if mode is None:
        return "show"
    if mode not in ("show", "hide"):
        out.schema.append(field_error("literal_error", [*loc, "option_keys"], 'option_keys must be "show" or "hide"',
                                      mode))
        return "show"
    return mode


def _choice(qid: str, q: dict, loc: list[Any], instructions: str, out: _Collector) -> Question | None:
    mode = _option_keys(q, loc, out)
    criteria = q.get("criteria")
    if criteria is None:
        out.schema.append(missing([*loc, "criteria"], q))
        return None
    if isinstance(criteria, list):
        ok = True
        named: dict[str, Any] = {}
        for i, item in enumerate(criteria):
            if not isinstance(item, str):
                out.schema.append(field_error("string_type", [*loc, "criteria", i], "Input should be a valid string",
                                              item))
                ok = False
            elif item not in named:
                named[item] = None
        if not ok:
            return None
        criteria = named
    elif isinstance(criteria, dict):
        before = len(out.schema)
        for key, desc in criteria.items():
            _check_text(desc, [*loc, "criteria", key], out)
        if len(out.schema) != before:
            return None
    else:
        out.schema.append(field_error("dict_type", [*loc, "criteria"], "Input should be a valid dictionary", criteria))
        return None
    if len(criteria) == 0:
        out.usage.append(f"Choice question must have at least one choice: {qid}")
        return None
    if len(criteria) > MAX_CHOICES:
        out.usage.append(f"Too many choices. Must have at most {MAX_CHOICES} choices.")
        return None
    if len(criteria) > MAX_OPTIONS:
        out.unsupported.append(("unsupported_option_count", ["body", "questions", qid],
                                f"choice questions with more than {MAX_OPTIONS} options are not supported yet "
                                f"by basal-local (got {len(criteria)})"))
        return None
    keys, shown = named_option_texts(criteria, mode)
    return Question(qid, "choice", instructions, tuple(keys), tuple(shown), "choice")


def _noul(qid: str, q: dict, loc: list[Any], instructions: str, out: _Collector) -> Question | None:
    _option_keys(q, loc, out)
    criteria = q.get("criteria")
    if criteria is not None and not isinstance(criteria, dict):
        out.schema.append(field_error("model_type", [*loc, "criteria"],
                                      "Input should be a valid dictionary or instance of NoulCriteria", criteria,
                                      {"class_name": "NoulCriteria"}))
        return None
    criteria = criteria or {}
    before = len(out.schema)
    for side in ("true", "false"):
        _check_text(criteria.get(side), [*loc, "criteria", side], out)
    if len(out.schema) != before:
        return None
    if q.get("instructions") is None and q.get("criteria") is None:
        out.usage.append(f"Noul question must have criteria or instructions: {qid}")
        return None
    true_desc, false_desc = criteria.get("true"), criteria.get("false")
    texts = ("" if true_desc is None else to_text(true_desc), "" if false_desc is None else to_text(false_desc))
    return Question(qid, "noul", instructions, ("true", "false"), texts, "noul",
                    default_yes_no=(true_desc is None, false_desc is None))


def _score(qid: str, q: dict, loc: list[Any], instructions: str, out: _Collector) -> Question | None:
    mode = _option_keys(q, loc, out)
    field = "criteria"
    levels = q.get("criteria")
    if levels is None and q.get("levels") is not None:
        field, levels = "levels", q["levels"]
    if levels is None:
        out.schema.append(missing([*loc, "criteria"], q))
        return None
    if isinstance(levels, list):
        if not levels:
            out.schema.append(field_error("too_short", [*loc, field],
                                          "List should have at least 1 item after validation, not 0", levels,
                                          {"field_type": "List", "min_length": 1, "actual_length": 0}))
            return None
        before = len(out.schema)
        for i, level in enumerate(levels):
            if not is_text_value(level):
                out.schema.extend(union_errors([*loc, field, i], level))
        if len(out.schema) != before:
            return None
        keys = [str(i) for i in range(len(levels))]
        shown = [to_text(level) for level in levels]
        legend = dict(zip(keys, levels))
    elif isinstance(levels, dict):
        if not levels:
            out.schema.append(field_error("too_short", [*loc, field],
                                          "Dictionary should have at least 1 item after validation, not 0", levels,
                                          {"field_type": "Dictionary", "min_length": 1, "actual_length": 0}))
            return None
        before = len(out.schema)
        for key, desc in levels.items():
            _check_text(desc, [*loc, field, key], out)
        if len(out.schema) != before:
            return None
        keys, shown = named_option_texts(levels, mode)
        legend = dict(levels)
    else:
        out.schema.append(field_error("list_type", [*loc, field], "Input should be a valid list", levels))
        return None
    if len(keys) > MAX_SCORE_LEVELS:
        out.usage.append(f"Too many score levels. Must have at most {MAX_SCORE_LEVELS} levels.")
        return None
    return Question(qid, "score", instructions, tuple(keys), tuple(shown), "score", legend=legend)


def _question(qid: str, q: Any, out: _Collector) -> Question | None:
    qloc: list[Any] = ["body", "questions", qid]
    if not isinstance(q, dict):
        out.schema.append(field_error("model_attributes_type", qloc, MSG_NOT_OBJECT, q))
        return None
    qtype = q.get("type")
    if qtype is None:
        out.schema.append(field_error("union_tag_not_found", qloc, "Unable to extract tag using discriminator 'type'",
                                      q, {"discriminator": "'type'"}))
        return None
    if not isinstance(qtype, str):
        out.usage.append(f"Invalid request. Question type {to_text(qtype)} is not a string: {qid}")
        return None
    if qtype not in KNOWN_TYPES and qtype not in EXTENSION_TYPES:
        out.usage.append(f'Invalid request. Unknown question type "{qtype}" ({", ".join(KNOWN_TYPES)}): {qid}')
        return None
    loc = [*qloc, qtype]
    raw_instructions = q.get("instructions")
    _check_text(raw_instructions, [*loc, "instructions"], out)
    instructions = "" if raw_instructions is None or not is_text_value(raw_instructions) else to_text(raw_instructions)
    if qtype in EXTENSION_TYPES:
        if qtype == "multi" and bool(q.get("evidence")):
            out.schema.append(field_error("value_error", [*qloc, "evidence"], "evidence is not supported for multi",
                                          q.get("evidence")))
            return None
        out.unsupported.append(("unsupported_feature", qloc,
                                f"question type {qtype} is not supported yet by basal-local"))
        return None
    builder = {"choice": _choice, "noul": _noul, "score": _score}[qtype]
    question = builder(qid, q, loc, instructions, out)
    if question is not None and bool(q.get("evidence")):
        out.unsupported.append(("unsupported_feature", qloc,
                                "evidence is not available for this model (no evidence_head.pt)"))
    return question


def validate_systemone(body: Any, model_name: str) -> DecisionRequest:
    """Validate a parsed body for the (already routed) model; raises ApiError with the exact body."""
    out = _Collector()
    if not isinstance(body, dict):
        raise validation_error([field_error("model_attributes_type", ["body"], MSG_NOT_OBJECT, body)])
    if "model" not in body or body["model"] is None:
        out.schema.append(missing(["body", "model"], body))
    elif not isinstance(body["model"], str):
        out.schema.append(field_error("string_type", ["body", "model"], "Input should be a valid string",
                                      body["model"]))
    state = body.get("state")
    if state is None:
        out.schema.append(missing(["body", "state"], body))
    elif not is_text_value(state):
        out.schema.extend(union_errors(["body", "state"], state))
    questions_raw = body.get("questions")
    questions: list[Question] = []
    if questions_raw is None:
        out.schema.append(missing(["body", "questions"], body))
    elif not isinstance(questions_raw, dict):
        out.schema.append(field_error("dict_type", ["body", "questions"], "Input should be a valid dictionary",
                                      questions_raw))
    elif not questions_raw:
        out.schema.append(field_error("too_short", ["body", "questions"],
                                      "Dictionary should have at least 1 item after validation, not 0", questions_raw,
                                      {"field_type": "Dictionary", "min_length": 1, "actual_length": 0}))
    else:
        for qid, q in questions_raw.items():
            question = _question(qid, q, out)
            if question is not None:
                questions.append(question)
    facts = body.get("facts")
    if facts is not None and facts not in ("off", "auto"):
        out.schema.append(field_error("literal_error", ["body", "facts"], 'facts must be "off" or "auto"', facts))
    if out.schema:
        raise validation_error(out.schema)
    if out.usage:
        raise usage_error(out.usage[0])
    if facts == "auto":
        out.unsupported.insert(0, ("unsupported_feature", ["body", "facts"],
                                   'facts "auto" is not supported yet by basal-local'))
    if out.unsupported:
        kind, loc, msg = out.unsupported[0]
        raise unsupported(kind, loc, msg)
    return DecisionRequest("systemone", model_name, to_text(state), questions)


def check_model_field(body: Any, served: dict[str, Any], default: str) -> str:
    """§1.1 routing: a string naming no served model is a 400; anything else goes to the default."""
    if isinstance(body, dict) and isinstance(body.get("model"), str):
        name = body["model"]
        if name not in served:
            raise usage_error(f"Unknown model: {name} (served: {', '.join(served)})")
        return name
    return default


__all__ = ["ApiError", "check_model_field", "validate_systemone"]

"""`POST /v1/systemone`: the strict TypeSafe dialect (docs/PROTOCOL.md §2, §2.1, §3).

All schema errors (422) of a request are collected into one `detail` list; usage errors (400) are
reported only when there is no schema error, and only the first; "unsupported" errors (422) come last,
for requests that are valid but that this runtime cannot answer.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from ..protocol.act import ActError, ActSpec, act_base, check_max_error, parse_costs
from ..protocol.constants import MAX_CHOICES, MAX_OPTIONS, MAX_SCORE_LEVELS
from ..protocol.facts import inject as inject_facts
from ..protocol.multi import MultiSpec, labels_of, truncate_count
from ..protocol.questions import DecisionRequest, Question
from ..protocol.render import named_option_texts
from ..protocol.textrule import is_text_value, to_text
from .errors import (
    MSG_NOT_OBJECT,
    ApiError,
    field_error,
    missing,
    union_errors,
    unknown_model,
    unsupported,
    usage_error,
    validation_error,
)
from .refusals import (
    MAX_PROMPTS,
    MAX_QUESTIONS,
    count_prompts,
    field_refusal,
    top_level_refusal,
    type_refusal,
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
    question = _noul_outcomes(qid, criteria, loc, instructions, out)
    if question is not None and q.get("instructions") is None and criteria is None:
        out.usage.append(f"Noul question must have criteria or instructions: {qid}")
        return None
    return question


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


def _number(q: dict, name: str, loc: list[Any], out: _Collector, integer: bool = False) -> bool:
    """A numeric field (multi threshold/max/min): bools and non-numbers are 422s."""
    value = q.get(name)
    if value is None or (isinstance(value, (int, float)) and not isinstance(value, bool)):
        return True
    kind, msg = ("int_type", "Input should be a valid integer") if integer else \
        ("float_type", "Input should be a valid number")
    out.schema.append(field_error(kind, [*loc, name], msg, value))
    return False


def _multi(qid: str, q: dict, loc: list[Any], instructions: str, out: _Collector) -> Question | None:
    criteria = q.get("criteria")
    if criteria is None:
        out.schema.append(missing([*loc, "criteria"], q))
        return None
    before = len(out.schema)
    if isinstance(criteria, list):
        for i, item in enumerate(criteria):
            if not isinstance(item, str):
                out.schema.append(field_error("string_type", [*loc, "criteria", i], "Input should be a valid string",
                                              item))
    elif isinstance(criteria, dict):
        for key, desc in criteria.items():
            _check_text(desc, [*loc, "criteria", key], out)
    else:
        out.schema.append(field_error("dict_type", [*loc, "criteria"], "Input should be a valid dictionary", criteria))
    numbers_ok = all([_number(q, "threshold", loc, out), _number(q, "max", loc, out, True),
                      _number(q, "min", loc, out, True)])
    if len(out.schema) != before or not numbers_ok:
        return None
    keys, labels = labels_of(criteria)  # type: ignore[misc]
    if not keys:
        out.usage.append(f"Multi question must have at least one label: {qid}")
        return None
    threshold = q.get("threshold")
    spec = MultiSpec(0.5 if threshold is None else float(threshold), truncate_count(q.get("max")),
                     truncate_count(q.get("min")))
    return Question(qid, "multi", instructions, tuple(keys), tuple(labels), "noul", spec=spec)


def _act(qid: str, q: dict, loc: list[Any], instructions: str, out: _Collector) -> Question | None:
    mode = q.get("option_keys") if q.get("option_keys") in ("show", "hide") else "show"
    criteria = q.get("criteria")
    try:
        base = act_base(criteria, q.get("base"))
    except ActError as exc:
        out.schema.append(field_error(exc.kind, [*loc, "base"], exc.msg, q.get("base")))
        return None
    if base == "noul":
        _option_keys(q, loc, out)
        question = _noul_outcomes(qid, criteria if isinstance(criteria, dict) else None, loc, instructions, out)
    else:
        question = _choice(qid, {**q, "criteria": criteria}, loc, instructions, out)
    if question is None:
        return None
    outcomes = list(question.keys)
    if len(outcomes) == 1:
        out.unsupported.append(("unsupported_single_option", ["body", "questions", qid],
                                "act questions need at least 2 outcomes (got 1)"))
        return None
    if len(outcomes) > MAX_OPTIONS:
        out.unsupported.append(("unsupported_option_count", ["body", "questions", qid],
                                f"act questions support at most {MAX_OPTIONS} outcomes (got {len(outcomes)})"))
        return None
    try:
        actions, rows, defer = parse_costs(q.get("costs"), outcomes, q.get("defer_action"))
        check_max_error(q.get("max_error"))
    except ActError as exc:
        value = q if exc.kind == "missing" else q.get(exc.field or "")
        out.schema.append(field_error(exc.kind, [*loc, exc.field], exc.msg, value))
        return None
    spec = ActSpec(base, tuple(actions), tuple(tuple(r) for r in rows), defer, q.get("max_error"), mode)
    return replace(question, qtype="act", calibration_key=base, spec=spec, legend=None)


def _noul_outcomes(qid: str, criteria: dict | None, loc: list[Any], instructions: str,
                   out: _Collector) -> Question | None:
    """true/false outcomes of a noul-based act; a missing or null description is the language default."""
    criteria = criteria or {}
    before = len(out.schema)
    for side in ("true", "false"):
        _check_text(criteria.get(side), [*loc, "criteria", side], out)
    if len(out.schema) != before:
        return None
    true_desc, false_desc = criteria.get("true"), criteria.get("false")
    texts = ("" if true_desc is None else to_text(true_desc), "" if false_desc is None else to_text(false_desc))
    return Question(qid, "noul", instructions, ("true", "false"), texts, "noul",
                    default_yes_no=(true_desc is None, false_desc is None))


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
    refused = type_refusal(qid, qtype, "systemone") or field_refusal(qid, qtype, q, "systemone")
    if refused is not None:
        out.unsupported.append(refused)
        return None
    if qtype not in KNOWN_TYPES and qtype not in EXTENSION_TYPES:
        out.usage.append(f'Invalid request. Unknown question type "{qtype}" ({", ".join(KNOWN_TYPES)}): {qid}')
        return None
    loc = [*qloc, qtype]
    raw_instructions = q.get("instructions")
    _check_text(raw_instructions, [*loc, "instructions"], out)
    instructions = "" if raw_instructions is None or not is_text_value(raw_instructions) else to_text(raw_instructions)
    if qtype == "multi" and bool(q.get("evidence")):
        out.schema.append(field_error("value_error", [*qloc, "evidence"], "evidence is not supported for multi",
                                      q.get("evidence")))
        return None
    builder = {"choice": _choice, "noul": _noul, "score": _score, "multi": _multi, "act": _act}[qtype]
    question = builder(qid, q, loc, instructions, out)
    if question is not None and bool(q.get("evidence")):
        if not 2 <= len(question.keys) <= MAX_OPTIONS:
            out.unsupported.append(("unsupported_feature", qloc, "evidence needs 2 to 10 options"))
            return None
        question = replace(question, evidence=True)
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
        check_counts(questions_raw)
        for qid, q in questions_raw.items():
            question = _question(qid, q, out)
            if question is not None:
                questions.append(question)
    refused = top_level_refusal(body)
    if refused is not None:
        out.unsupported.insert(0, refused)
    facts = body.get("facts")
    if facts is not None and facts not in ("off", "auto"):
        out.schema.append(field_error("literal_error", ["body", "facts"], 'facts must be "off" or "auto"', facts))
    if out.schema:
        raise validation_error(out.schema)
    state_text = to_text(state)
    limit = None
    if facts == "auto":
        try:
            injected = inject_facts(state_text)
        except (ArithmeticError, ValueError) as exc:
            raise validation_error([field_error("value_error", ["body", "state"], str(exc), state)]) from None
        state_text, limit = injected, len(state_text)
    if out.usage:
        raise usage_error(out.usage[0])
    if out.unsupported:
        kind, loc, msg = out.unsupported[0]
        raise unsupported(kind, loc, msg)
    return DecisionRequest("systemone", model_name, state_text, questions, limit)


def check_counts(questions: dict) -> None:
    """The per-request limits (api/refusals.py), checked before any question is looked at: a 400 like §2's
    "Too many choices"."""
    if len(questions) > MAX_QUESTIONS:
        raise usage_error(f"Too many questions. Must have at most {MAX_QUESTIONS} questions per request "
                          f"(got {len(questions)}).")
    prompts = count_prompts(questions)
    if prompts > MAX_PROMPTS:
        raise usage_error(f"Too many prompts. A request may need at most {MAX_PROMPTS} prompts (these "
                          f"questions need {prompts}).")


def check_model_field(body: Any, served: dict[str, Any], default: str) -> str:
    """§1.1 routing: a string naming no served model is a 400 with TypeSafe's exact message (the served names
    go to a header); anything else goes to the default."""
    if isinstance(body, dict) and isinstance(body.get("model"), str):
        name = body["model"]
        if name not in served:
            raise unknown_model(usage_error(f"Unknown model: {name}"), served)
        return name
    return default


__all__ = ["ApiError", "check_model_field", "validate_systemone"]

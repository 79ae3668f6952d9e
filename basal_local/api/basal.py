"""`POST /v1/basal`: the lenient upstream dialect (docs/PROTOCOL.md §8). Every failure is 422 {"error": ...}."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from ..protocol.act import ActError, ActSpec, act_base, check_max_error, parse_costs
from ..protocol.constants import MAX_CHOICES, MAX_OPTIONS
from ..protocol.facts import inject as inject_facts
from ..protocol.multi import MultiSpec, labels_of, selection_options, truncate_count
from ..protocol.questions import DecisionRequest, Question, detect_language
from ..protocol.render import named_option_texts
from ..protocol.textrule import to_text
from ..protocol.tools import tool_options
from .errors import basal_error, unknown_model, unsupported
from .refusals import (
    MAX_PROMPTS,
    MAX_QUESTIONS,
    SUPPORTED_TYPES,
    count_prompts,
    field_refusal,
    top_level_refusal,
    type_refusal,
)

KNOWN_TYPES = ("choice", "noul", "score", "multi", "act", "tool")


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


def _number(qid: str, q: dict, name: str) -> Any:
    value = q.get(name)
    if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
        raise ValueError(f"question '{qid}': {name} must be a number, got {to_text(value)}")
    return value


def _multi(qid: str, q: dict, instructions: str) -> Question:
    if q.get("evidence"):
        raise ValueError(f"question '{qid}': evidence is not supported for multi")
    found = labels_of(q.get("criteria"))
    if not found or not found[0]:
        raise ValueError(f"question '{qid}': multi needs at least one label in criteria")
    keys, labels = found
    threshold = _number(qid, q, "threshold")
    try:
        options = selection_options(q, keys)
    except ValueError as exc:
        raise ValueError(f"question '{qid}': {exc}") from None
    spec = MultiSpec(0.5 if threshold is None else float(threshold), truncate_count(_number(qid, q, "max")),
                     truncate_count(_number(qid, q, "min")), **options)
    return Question(qid, "multi", instructions, tuple(keys), tuple(labels), "noul", spec=spec)


def _act(qid: str, q: dict, instructions: str) -> Question:
    criteria = q.get("criteria")
    try:
        base = act_base(criteria, q.get("base"))
        if base == "noul":
            outcome = _noul(qid, criteria if isinstance(criteria, dict) else {}, instructions)
            mode = q.get("option_keys") or "show"
        else:
            keys, shown, mode = _options(qid, {**q, "type": "choice"}, "choice")
            if not 2 <= len(keys) <= MAX_OPTIONS:
                raise ValueError(f"question '{qid}': {len(keys)} options (supported: 2..{MAX_OPTIONS})")
            outcome = Question(qid, "choice", instructions, tuple(keys), tuple(shown), base)
        actions, rows, defer = parse_costs(q.get("costs"), list(outcome.keys), q.get("defer_action"))
        check_max_error(q.get("max_error"))
    except ActError as exc:
        raise ValueError(f"question '{qid}': {exc.field + ': ' if exc.field else ''}{exc.msg}") from None
    spec = ActSpec(base, tuple(actions), tuple(tuple(r) for r in rows), defer, q.get("max_error"), mode)
    return replace(outcome, qtype="act", calibration_key=base, spec=spec)


def _noul(qid: str, criteria: dict, instructions: str) -> Question:
    """Noul options; any falsy description falls back to the language default (upstream)."""
    descs = [criteria.get("true"), criteria.get("false")]
    texts = tuple(to_text(d) if d else "" for d in descs)
    return Question(qid, "noul", instructions, ("true", "false"), texts, "noul",
                    default_yes_no=(not descs[0], not descs[1]))


def _tool(qid: str, q: dict, instructions: str, lang: str) -> Question:
    try:
        options, spec = tool_options(q, lang)
        selection = selection_options(q, list(options)) if spec.multi else {}
    except ValueError as exc:
        raise ValueError(f"question '{qid}': {exc}") from None
    if spec.multi:
        threshold = _number(qid, q, "threshold")
        multi = MultiSpec(0.5 if threshold is None else float(threshold), truncate_count(_number(qid, q, "max")),
                          truncate_count(_number(qid, q, "min")), **selection)
        labels = [k if d is None else f"{k}: {d}" for k, d in options.items()]
        return Question(qid, "multi", instructions, tuple(options), tuple(labels), "noul", spec=multi, tool=spec)
    keys, shown = named_option_texts(options, "show")
    if not 2 <= len(keys) <= MAX_CHOICES:
        raise ValueError(f"question '{qid}': {len(keys)} options, tools and extra together (supported: 2..{MAX_CHOICES})")
    return Question(qid, "choice", instructions, tuple(keys), tuple(shown), "choice", tool=spec)


def _question(qid: str, q: Any, state_text: str = "") -> Question:
    question = _typed_question(qid, q, state_text)
    if isinstance(q, dict) and q.get("evidence"):
        question = replace(question, evidence=True)
    return question


def _typed_question(qid: str, q: Any, state_text: str) -> Question:
    if not isinstance(q, dict):
        raise ValueError(f"question '{qid}' must be a JSON object")
    raw_type = q.get("type")
    qtype = raw_type if raw_type in ("choice", "noul", "score") else "choice"
    calibration_key = qtype if raw_type in ("choice", "noul", "score") else None
    instructions = to_text(q["instructions"]) if "instructions" in q else ""
    if raw_type == "tool":
        return _tool(qid, q, instructions, detect_language(state_text, instructions))
    if raw_type == "multi":
        return _multi(qid, q, instructions)
    if raw_type == "act":
        return _act(qid, q, instructions)
    if qtype == "noul":
        return _noul(qid, q.get("criteria") if isinstance(q.get("criteria"), dict) else {}, instructions)
    keys, shown, _ = _options(qid, q, qtype)
    if not 2 <= len(keys) <= MAX_OPTIONS:
        if raw_type is not None and raw_type not in KNOWN_TYPES:  # read as choice (§8), but say what it was
            raise ValueError(f"question '{qid}': unknown type {to_text(raw_type)!r} read as a choice: {len(keys)} "
                             f"options (supported: 2..{MAX_OPTIONS}; types: {SUPPORTED_TYPES['basal']})")
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
    _check_counts(questions)
    state_text = to_text(body["state"])
    limit, facts_error = None, None
    if body.get("facts") == "auto":  # lenient: anything but "auto" means no facts
        try:
            state_text, limit = inject_facts(state_text), len(state_text)
        except (ArithmeticError, ValueError) as exc:
            facts_error = str(exc)
    messages: list[str] = []
    parsed: list[Question] = []
    refused = [top_level_refusal(body)]
    for qid, q in questions.items():
        if isinstance(q, dict):
            refusal = type_refusal(qid, q.get("type"), "basal") or field_refusal(qid, q.get("type"), q, "basal")
            if refusal is not None:
                refused.append(refusal)
                continue
        try:
            parsed.append(_question(qid, q, state_text))  # the state decides the language of tool extras
        except ValueError as exc:
            messages.append(str(exc))
    if messages:
        raise basal_error("; ".join(messages))
    if facts_error is not None:
        raise basal_error(facts_error)
    first = next((r for r in refused if r is not None), None)
    if first is not None:
        raise unsupported(*first)
    return DecisionRequest("basal", model_name, state_text, parsed, limit)


def _check_counts(questions: dict) -> None:
    """The per-request limits (api/refusals.py), before any question is looked at."""
    if len(questions) > MAX_QUESTIONS:
        raise basal_error(f"too many questions: {len(questions)} (at most {MAX_QUESTIONS} per request)")
    prompts = count_prompts(questions)
    if prompts > MAX_PROMPTS:
        raise basal_error(f"too many prompts: these questions need {prompts} (at most {MAX_PROMPTS} per request)")


def route_basal(body: Any, served: dict[str, Any], default: str) -> str:
    if isinstance(body, dict) and isinstance(body.get("model"), str):
        if body["model"] not in served:
            raise unknown_model(basal_error(f"Unknown model: {body['model']}"), served)
        return body["model"]
    return default

"""`tool` questions of the basal dialect: which tool to call, as a typed decision (never executed here).

A tool question is a choice (or, with `multi`, a multi) whose options are tool definitions, in the three shapes the
clients send: OpenAI (`{"type": "function", "function": {"name", "description", "parameters"}}`, or the flat
`{"name", "description", "parameters"}`), MCP (`inputSchema`) and Anthropic (`input_schema`). Each becomes an option
keyed by the tool's name and shown as "name: description", the description cut to `description_chars` Unicode
characters (default 300, 0 = whole) at a word boundary where possible, with an ellipsis. The non-tool choices of
`extra` (`answer_directly`, `ask_user`, `none`) follow the tools as further options; without `extra` a single-tool
question offers all three and a multi question none (the client's documented default). Parameters are not shown:
the model chooses by name and purpose.

The answer (`type: "tool"`): `tool` is the chosen option's key and `call` says whether it is a tool (false for a
non-tool choice); `confidence` and `probabilities` as for a choice; `ranking` the `rank` most probable options
(default: all) with their probabilities. With `max_error`, the certified confidence threshold of CALIBRATION.json
for that target decides: below it the answer defers (`tool: null`, `call: false`, `deferred: true`); a target
without a certified threshold answers as usual and says `"max_error": "no certified threshold for this target"`.
With `multi`, the selection options of multi apply and `tools` lists the selected keys.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .textrule import to_text

EXTRAS = ("answer_directly", "ask_user", "none")
EXTRA_TEXTS = {
    "en": {"answer_directly": "Answer directly, without a tool", "ask_user": "Ask the user for more information",
           "none": "None of these"},
    "pl": {"answer_directly": "Odpowiedz bezpośrednio, bez narzędzia",
           "ask_user": "Zapytaj użytkownika o więcej informacji", "none": "Żadne z powyższych"},
}
DEFAULT_DESCRIPTION_CHARS = 300
NO_CERTIFIED_THRESHOLD = "no certified threshold for this target"


@dataclass(frozen=True)
class ToolSpec:
    """What turns the choice (or multi) answer into a tool answer."""

    tools: tuple[str, ...]
    extras: tuple[str, ...]
    rank: int | None = None
    max_error: float | None = None
    multi: bool = False


def _definition(index: int, item: Any) -> tuple[str, str | None]:
    """(name, description) of one definition in any of the three shapes; ValueError names what is wrong."""
    if not isinstance(item, dict):
        raise ValueError(f"tools[{index}] must be a tool definition object")
    inner = item.get("function") if isinstance(item.get("function"), dict) else item
    name = inner.get("name")
    if not isinstance(name, str) or not name.strip():
        raise ValueError(f"tools[{index}] has no name")
    description = inner.get("description")
    if description is not None and not isinstance(description, str):
        description = to_text(description)
    return name, description or None


def shorten(text: str, limit: int) -> str:
    """`text` cut to `limit` characters (ellipsis included) at a word boundary where one is in the last half."""
    if limit <= 0 or len(text) <= limit:
        return text
    cut = text[: max(limit - 1, 1)]
    space = cut.rfind(" ")
    if not text[len(cut)].isspace() and space >= len(cut) // 2:  # mid-word: back to the last space
        cut = cut[:space]
    return cut.rstrip() + "…"


def tool_options(q: dict, lang: str) -> tuple[dict[str, str | None], ToolSpec]:
    """The option map (key -> description, None = the key alone) and the spec of a tool question."""
    tools = q.get("tools")
    if not isinstance(tools, list) or not tools:
        raise ValueError("tool needs a non-empty array of tool definitions in tools")
    limit = q.get("description_chars", DEFAULT_DESCRIPTION_CHARS)
    if isinstance(limit, bool) or not isinstance(limit, int) or limit < 0:
        raise ValueError(f"description_chars must be a non-negative integer, got {to_text(limit)}")
    multi = q.get("multi", False)
    if not isinstance(multi, bool):
        raise ValueError(f"multi must be true or false, got {to_text(multi)}")
    options: dict[str, str | None] = {}
    for i, item in enumerate(tools):
        name, description = _definition(i, item)
        if name in options:
            raise ValueError(f"tools has two tools named {name}")
        options[name] = None if description is None else shorten(description, limit)
    extra = q.get("extra")
    if extra is None:
        extras: tuple[str, ...] = () if multi else EXTRAS
    elif isinstance(extra, list) and all(e in EXTRAS for e in extra):
        extras = tuple(dict.fromkeys(extra))
    else:
        raise ValueError(f"extra must be an array of {', '.join(EXTRAS)}")
    for key in extras:
        if key in options:
            raise ValueError(f"a tool is named {key}, which is also a non-tool choice of extra")
        options[key] = EXTRA_TEXTS[lang][key]
    rank = q.get("rank")
    if rank is not None and (isinstance(rank, bool) or not isinstance(rank, int) or rank < 1):
        raise ValueError(f"rank must be a positive integer, got {to_text(rank)}")
    max_error = q.get("max_error")
    if max_error is not None and (isinstance(max_error, bool) or not isinstance(max_error, (int, float))):
        raise ValueError("max_error must be a number (a target error rate, e.g. 0.05)")
    if not multi:
        given = [k for k in ("objective", "threshold", "min", "max", "exclusive", "fallback", "fallback_threshold")
                 if q.get(k) is not None]
        if given:
            raise ValueError(f"{given[0]} is a selection option of multi tool questions (set multi: true)")
    return options, ToolSpec(tuple(o for o in options if o not in extras), extras, rank, max_error, multi)


def _ranking(probabilities: dict[str, float], rank: int | None) -> list[dict[str, Any]]:
    ordered = sorted(probabilities.items(), key=lambda kv: -kv[1])  # stable: ties keep option order
    return [{"tool": key, "probability": p} for key, p in ordered[: rank or len(ordered)]]


def tool_answer(spec: ToolSpec, base: dict[str, Any], thresholds: dict[str, float]) -> dict[str, Any]:
    """The tool answer from the answer of the choice (or multi) the question was asked as."""
    probabilities = base["probabilities"]
    out: dict[str, Any] = {"type": "tool", "multi": spec.multi}
    if spec.multi:
        selected = base["selected"]
        out.update(call=any(k in spec.tools for k in selected), tools=selected, probabilities=probabilities)
        out.update({k: v for k, v in base.items() if k not in ("type", "selected", "probabilities")})
    else:
        chosen, confidence = base["choice"], base["confidence"]
        out.update(call=chosen in spec.tools, tool=chosen, confidence=confidence, probabilities=probabilities,
                   deferred=False)
        if spec.max_error is not None:
            threshold = thresholds.get(str(spec.max_error))
            if threshold is None:
                out["max_error"] = NO_CERTIFIED_THRESHOLD
            elif confidence < threshold:
                out.update(tool=None, call=False, deferred=True)
    out["ranking"] = _ranking(probabilities, spec.rank)
    return out

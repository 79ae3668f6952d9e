"""`act` questions (docs/PROTOCOL.md §6.5): outcomes read like noul or choice, then a cost-minimising action.

`parse_act` turns the question's `criteria`, `base`, `costs`, `defer_action` and `max_error` into an ActSpec
or raises ActError (each dialect words the error its own way); `act_answer` applies the decision rule to
the calibrated outcome probabilities.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from .decision import argmax_first

NO_THRESHOLD = "no certified threshold for this target"
NEEDS_DEFER = 'max_error needs a defer action ("defer"/"human" or defer_action)'


class ActError(ValueError):
    """An invalid act question. `kind` is the pydantic-style type, `field` the question field it concerns."""

    def __init__(self, kind: str, field: str | None, msg: str) -> None:
        super().__init__(msg)
        self.kind = kind
        self.field = field
        self.msg = msg


@dataclass(frozen=True)
class ActSpec:
    base: str  # "noul", "choice" or "score": the readout and its temperature
    actions: tuple[str, ...]
    costs: tuple[tuple[float, ...], ...]  # costs[a][y], outcomes in the question's key order
    defer_action: str | None
    max_error: Any = None  # the number as given (its str() is the CALIBRATION key)
    option_keys: str = "show"


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def act_base(criteria: Any, base: Any) -> str:
    """noul when the criteria only know true/false (or are absent without a base) or base says so."""
    if base == "noul":
        return "noul"
    if isinstance(criteria, dict) and set(criteria) <= {"true", "false"}:
        return "noul"
    if criteria is None and base is None:
        return "noul"
    if base is None or base == "choice":
        return "choice"
    if base == "score":
        return "score"
    raise ActError("literal_error", "base", f"unsupported act base {base!r} (noul, choice or score)")


def parse_costs(costs: Any, outcomes: Sequence[str], defer_action: Any) -> tuple[list[str], list[list[float]],
                                                                                    str | None]:
    """(actions, cost rows, defer action) from the short (`wrong`/`defer`) or the full form."""
    if costs is None:
        raise ActError("missing", "costs", "Field required")
    if not isinstance(costs, dict) or not costs:
        raise ActError("value_error", "costs", "costs must be a non-empty object of actions")
    if set(costs) <= {"wrong", "defer"} and not isinstance(costs.get("wrong"), dict):
        wrong, defer = costs.get("wrong"), costs.get("defer")
        if not _is_number(wrong):
            raise ActError("value_error", "costs", 'costs["wrong"] must be a number (the cost of a wrong action)')
        if defer is not None and not _is_number(defer):
            raise ActError("value_error", "costs", 'costs["defer"] must be a number')
        actions = list(outcomes)
        rows = [[0.0 if y == a else float(wrong) for y in outcomes] for a in actions]
        if defer is None:
            return actions, rows, None
        return [*actions, "defer"], [*rows, [float(defer)] * len(outcomes)], "defer"
    actions, rows = [], []
    for action, row in costs.items():
        if not isinstance(row, dict) or set(row) != set(outcomes):
            raise ActError("value_error", "costs",
                           f'costs["{action}"] must give a cost for every outcome {list(outcomes)!r}')
        values = [row[y] for y in outcomes]
        if not all(_is_number(v) for v in values):
            raise ActError("value_error", "costs", f'costs["{action}"] must give numbers')
        actions.append(action)
        rows.append([float(v) for v in values])
    if isinstance(defer_action, str) and defer_action:
        if defer_action not in costs:
            raise ActError("value_error", "defer_action",
                           f'defer_action "{defer_action}" is not one of the actions in costs')
        return actions, rows, defer_action
    for name in ("defer", "human"):
        if name in costs:
            return actions, rows, name
    return actions, rows, None


def check_max_error(value: Any) -> None:
    if value is not None and not _is_number(value):
        raise ActError("value_error", "max_error", "max_error must be a number (a target error rate, e.g. 0.05)")


def act_answer(spec: ActSpec, outcomes: Sequence[str], p_cal: Sequence[float], thresholds: dict[str, float],
               calibrated: bool) -> dict[str, Any]:
    """The act answer; raises ActError(value_error) when max_error refuses and there is no defer action."""
    expected = [sum(p * c for p, c in zip(p_cal, row)) for row in spec.costs]
    best = min(range(len(expected)), key=lambda a: (expected[a], a))
    action = spec.actions[best]
    confidence = max(p_cal)
    out: dict[str, Any] = {"type": "act", "action": action,
                           "expected_costs": {a: round(e, 6) for a, e in zip(spec.actions, expected)},
                           "answer": outcomes[argmax_first(p_cal)],
                           "probabilities": dict(zip(outcomes, p_cal)), "confidence": confidence}
    if spec.max_error is not None:
        threshold = thresholds.get(str(spec.max_error))
        if threshold is None:
            out["max_error"] = NO_THRESHOLD
        elif confidence < threshold and action != spec.defer_action:
            if spec.defer_action is None:
                raise ActError("value_error", None, NEEDS_DEFER)
            out["action"] = spec.defer_action
            out["refused"] = action
    validated = calibrated and (spec.base == "noul" or spec.option_keys == "hide")
    out["calibration"] = "validated" if validated else "unvalidated"
    return out

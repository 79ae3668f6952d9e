"""The two wire dialects: parsing, routing and validation into DecisionRequest, exact error bodies."""

from __future__ import annotations

import logging
from typing import Any

from ..protocol.questions import DecisionRequest
from ..protocol.textrule import JsonSyntaxError, parse_json
from .basal import route_basal, validate_basal
from .errors import SERVED_MODELS_HEADER, ApiError, basal_error, json_invalid
from .systemone import check_model_field, validate_systemone


def parse_body(raw: bytes, dialect: str) -> Any:
    """JSON of a request body; invalid JSON raises the dialect's error (422 json_invalid / 422 {"error"})."""
    try:
        return parse_json(raw)
    except JsonSyntaxError as exc:
        if dialect == "systemone":
            raise json_invalid(exc.msg, exc.pos) from None
        raise basal_error(str(exc)) from None


def route(body: Any, dialect: str, served: dict[str, Any], default: str, aliases: dict[str, str] | None = None) -> str:
    """The served model a body asks for (docs/PROTOCOL.md §1.1, aliases resolved); an unknown name is the dialect's error."""
    if aliases and isinstance(body, dict) and isinstance(body.get("model"), str) and body["model"] in aliases:
        return aliases[body["model"]]
    try:
        return (check_model_field if dialect == "systemone" else route_basal)(body, served, default)
    except ApiError as err:
        if err.headers and SERVED_MODELS_HEADER in err.headers:
            logging.getLogger("basal_local.api").info("unknown model %r asked (served: %s)", body.get("model"),
                                                      err.headers[SERVED_MODELS_HEADER])
        raise


def validate(body: Any, dialect: str, model: str) -> DecisionRequest:
    return (validate_systemone if dialect == "systemone" else validate_basal)(body, model)


__all__ = ["ApiError", "parse_body", "route", "validate"]

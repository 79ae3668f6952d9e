"""Error bodies of both dialects (docs/PROTOCOL.md §1.2, §2.1, §8)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..protocol.errors import AnswerRefused, ProtocolError

UNION_MEMBERS = (
    ("string_type", "str", "Input should be a valid string"),
    ("dict_type", "dict[any,any]", "Input should be a valid dictionary"),
    ("list_type", "list[any]", "Input should be a valid list"),
)
MSG_NOT_OBJECT = "Input should be a valid dictionary or object to extract fields from"


@dataclass
class ApiError(Exception):
    """An HTTP error answer: status, JSON body, extra headers."""

    status: int
    body: Any
    headers: dict[str, str] | None = None


def field_error(kind: str, loc: list[Any], msg: str, value: Any = ..., ctx: dict[str, Any] | None = None) -> dict:
    """A pydantic-style item, keys in the order type, loc, msg, input, ctx."""
    item: dict[str, Any] = {"type": kind, "loc": loc, "msg": msg}
    if value is not ...:
        item["input"] = value
    if ctx is not None:
        item["ctx"] = ctx
    return item


def union_errors(loc: list[Any], value: Any) -> list[dict]:
    """A value that is none of string/object/array: three errors, one per union member."""
    return [field_error(kind, [*loc, suffix], msg, value) for kind, suffix, msg in UNION_MEMBERS]


def missing(loc: list[Any], parent: Any) -> dict:
    return field_error("missing", loc, "Field required", parent)


def validation_error(items: list[dict]) -> ApiError:
    return ApiError(422, {"detail": items})


def usage_error(message: str) -> ApiError:
    return ApiError(400, {"detail": {"error_type": "api_usage_error", "message": message}})


def unsupported(kind: str, loc: list[Any], msg: str) -> ApiError:
    return ApiError(422, {"error": "unsupported", "detail": [{"type": kind, "loc": loc, "msg": msg}]})


SERVED_MODELS_HEADER = "x-basal-served-models"


def unknown_model(err: ApiError, served: Any) -> ApiError:
    """The dialect's exact unknown-model error (docs/PROTOCOL.md §1.1); the served names ride in a header."""
    names = ", ".join(served).encode("ascii", "backslashreplace").decode("ascii")
    err.headers = {**(err.headers or {}), SERVED_MODELS_HEADER: names}
    return err


def json_invalid(msg: str, pos: int) -> ApiError:
    ctx_msg = msg[:1].upper() + msg[1:]
    return ApiError(422, {"detail": [field_error("json_invalid", ["body", pos], "JSON decode error", {},
                                                 {"error": ctx_msg})]})


def overloaded(dialect: str, headers: dict[str, str] | None = None) -> ApiError:
    """529 with the retry slot's headers (engine/gate.py `Admission`; §1.2's `Retry-After: 1` by default)."""
    if dialect == "systemone":
        body: Any = {"detail": {"error_type": "overloaded_error",
                                "message": "Too many requests in flight. Retry after a short delay."}}
    else:
        body = {"error": "overloaded: too many requests in flight"}
    return ApiError(529, body, headers or {"retry-after": "1", "retry-after-ms": "1000"})


def basal_error(message: str) -> ApiError:
    return ApiError(422, {"error": message})


def internal(detail: str, dialect: str | None = "systemone") -> ApiError:
    """A failure of ours (docs/PROTOCOL.md §2.1 shape on /v1/systemone; `{"error"}` on /v1/basal)."""
    if dialect == "basal":
        return ApiError(500, {"error": f"internal: {detail}"})
    if dialect == "systemone":
        return ApiError(500, {"error": "internal", "detail": detail})
    return ApiError(500, {"error": f"internal: {detail}", "code": "INTERNAL"})


def protocol_error(exc: ProtocolError, dialect: str) -> ApiError:
    """A valid request the runtime cannot answer: §2.1 "unsupported" on /v1/systemone, §8 422 on /v1/basal."""
    if dialect == "systemone" or exc.same_body_on_both_dialects:
        loc: list[Any] = ["body", "questions", exc.qid] if exc.qid is not None else ["body"]
        return unsupported(exc.kind, loc, exc.message)
    return basal_error(exc.message)


def refusal_error(exc: AnswerRefused, dialect: str) -> ApiError:
    """An answer refused by the decision rule (§2.1, last line): a 422 `value_error` at the question."""
    if dialect == "systemone":
        return validation_error([field_error("value_error", ["body", "questions", exc.qid], exc.message)])
    return basal_error(f"question '{exc.qid}': {exc.message}")


# TypeSafe's direct API errors name their class (docs/WIRE.md: `{"detail":{"error_type","message"}}`).
SYSTEMONE_ERROR_TYPES = {401: "authentication_error", 403: "permission_error", 404: "not_found_error",
                         408: "timeout_error", 413: "request_too_large", 503: "unavailable_error"}


def http_error(status: int, code: str, message: str, dialect: str | None,
               headers: dict[str, str] | None = None) -> ApiError:
    """An error of the HTTP layer (encoding, size, auth, host, content type...) in the dialect's shape.

    `/v1/systemone`: `{"detail": {"error_type", "message"}}`; `/v1/basal`: `{"error": message}` (§8);
    every other path: `{"error": message, "code": CODE}` (docs/WIRE.md).
    """
    if dialect == "systemone":
        kind = SYSTEMONE_ERROR_TYPES.get(status, "api_usage_error")
        return ApiError(status, {"detail": {"error_type": kind, "message": message}}, headers)
    if dialect == "basal":
        return ApiError(status, {"error": message}, headers)
    return ApiError(status, {"error": message, "code": code}, headers)


def dialect_of(path: str) -> str | None:
    """The wire dialect a path speaks (None: the daemon's own endpoints); spelled as the router reads it (repeated
    slashes are one: `//v1/basal` is served as /v1/basal, so its errors take that dialect's shape too)."""
    path = "/" + "/".join(part for part in path.split("/") if part)
    if path == "/v1/systemone":
        return "systemone"
    if path == "/v1/basal":
        return "basal"
    return None

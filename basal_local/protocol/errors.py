"""Errors of the decision protocol itself, raised below the wire dialects; each dialect shapes them.

The engine plans requests and may find one it cannot answer (a prompt longer than the model's context).
It raises these plain exceptions; `api/errors.py` turns them into `/v1/systemone`'s or `/v1/basal`'s body.
"""

from __future__ import annotations


class ProtocolError(ValueError):
    """A valid request this runtime cannot answer; `kind` is the System One error type."""

    kind = "unsupported_feature"

    def __init__(self, message: str, qid: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.qid = qid


class ContextTooLong(ProtocolError):
    """A question's prompt has more tokens than the model's context (`at_least`: a cheap lower bound)."""

    kind = "context_length_exceeded"

    def __init__(self, qid: str, tokens: int, limit: int, model: str, at_least: bool = False) -> None:
        count = f"at least {tokens}" if at_least else str(tokens)
        super().__init__(f"the prompt has {count} tokens, more than the maximum context length of {limit} "
                         f"tokens of model {model}", qid)
        self.tokens = tokens
        self.limit = limit

"""Errors of the decision protocol itself, raised below the wire dialects; each dialect shapes them.

The engine plans requests and may find one it cannot answer (a prompt longer than the model's context, a
model without an evidence head) or an answer that refuses (act `max_error` without a defer action). It raises
these plain exceptions; `api/errors.py` turns them into `/v1/systemone`'s or `/v1/basal`'s body.
"""

from __future__ import annotations


class ProtocolError(ValueError):
    """A valid request this runtime cannot answer; `kind` is the System One error type."""

    kind = "unsupported_feature"
    # True: `/v1/basal` answers the System One "unsupported" body too (what the evidence-head error always did)
    same_body_on_both_dialects = False

    def __init__(self, message: str, qid: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.qid = qid


class NoEvidenceHead(ProtocolError):
    """Evidence was asked of a model directory without `evidence_head.pt` (docs/PROTOCOL.md §2.1)."""

    same_body_on_both_dialects = True

    def __init__(self, qid: str) -> None:
        super().__init__("evidence is not available for this model (no evidence_head.pt)", qid)


class ContextTooLong(ProtocolError):
    """A question's prompt has more tokens than the model's context (`at_least`: a cheap lower bound)."""

    kind = "context_length_exceeded"

    def __init__(self, qid: str, tokens: int, limit: int, model: str, at_least: bool = False) -> None:
        count = f"at least {tokens}" if at_least else str(tokens)
        super().__init__(f"the prompt has {count} tokens, more than the maximum context length of {limit} "
                         f"tokens of model {model}", qid)
        self.tokens = tokens
        self.limit = limit


class AnswerRefused(ValueError):
    """An answer the decision rule refuses to give (act `max_error` without a defer action, docs/PROTOCOL.md §6.5):
    a 422 `value_error` located at the question on `/v1/systemone`, `{"error"}` naming it on `/v1/basal`."""

    def __init__(self, qid: str, message: str) -> None:
        super().__init__(message)
        self.qid = qid
        self.message = message

"""Evidence forwards (docs/PROTOCOL.md §6.8): one plain causal forward per question that asked for spans.

They run on arrival, after planning and before the request is queued: the spans do not depend on the
letter logits, so `finish` only appends them. The forward takes the device gate like a main-lane batch.
Its tokens are not part of `usage.input_tokens`.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..protocol.errors import NoEvidenceHead
from ..protocol.evidence import select_spans, state_chars, state_tokens
from .plan import RequestPlan


def attach_evidence(plan: RequestPlan, engine: Any) -> None:
    """Compute the spans of every question with `evidence` into `plan.evidence`; 422 when there is no head.

    An engine with its own `attach_evidence` (replicas in worker processes) computes them where its device is."""
    own = getattr(engine, "attach_evidence", None)
    if own is not None:
        own(plan)
        return
    request = plan.request
    wanted = [q for q in request.questions if q.evidence]
    if not wanted:
        return
    head = engine.model.evidence_head
    if head is None:
        raise NoEvidenceHead(wanted[0].qid)
    tokenizer = engine.model.tokenizer
    units = {qp.question.qid: qp for qp in plan.questions if qp.role == "main"}
    for q in wanted:
        prompt = units[q.qid].prompts[0]  # perm0, the original order
        ids, offsets = tokenizer.encode_offsets(prompt)
        chars = state_chars(prompt, request.state_text)
        span = state_tokens(offsets, *chars) if chars else None
        if span is None:
            plan.evidence[q.qid] = []
            continue
        t0, t1 = span
        engine.gate.acquire(urgent=True)
        try:
            hidden = engine.backend.final_hidden(np.asarray(ids, dtype=np.int64))
        finally:
            engine.gate.release()
        start, end = head.scores(hidden[t0:t1], hidden[-1])
        s0 = chars[0]
        plan.evidence[q.qid] = select_spans(start, end, [offsets[i][0] - s0 for i in range(t0, t1)],
                                            [offsets[i][1] - s0 for i in range(t0, t1)], request.state_text,
                                            request.state_limit)

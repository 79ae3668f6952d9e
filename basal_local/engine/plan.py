"""Planning (on arrival): render, tokenize and size a validated request; turn letter logits into answers."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..model.directory import Calibration
from ..model.tokenizer import BasalTokenizer
from ..protocol.answers import answer, usage
from ..protocol.decision import average_orders, calibrate
from ..protocol.errors import ContextTooLong
from ..protocol.questions import DecisionRequest, Question
from ..protocol.render import render_question
from .packer import PromptSpec, TrieSizer


@dataclass
class QuestionPlan:
    question: Question
    lang: str
    perms: list[list[int]]
    prompts: list[str]
    token_ids: list[list[int]]
    letter_ids: list[int]


@dataclass
class RequestPlan:
    request: DecisionRequest
    questions: list[QuestionPlan]
    input_tokens: int
    packed_tokens: int  # tokens a forward computes for this request alone (cached template excluded)
    arrival: float = field(default_factory=time.perf_counter)
    planning_s: float = 0.0

    def prompt_specs(self) -> list[PromptSpec]:
        return [PromptSpec(ids, qp.lang, qp.letter_ids) for qp in self.questions for ids in qp.token_ids]


def plan_request(request: DecisionRequest, tokenizer: BasalTokenizer, max_positions: int,
                 prefixes: dict[str, Sequence[int]] | None = None) -> RequestPlan:
    """Render both orders of every question and tokenize them; raises ContextTooLong for too-long prompts."""
    started = time.perf_counter()
    check_size_cheaply(request, tokenizer, max_positions)
    rendered = []
    texts: list[str] = []
    for q in request.questions:
        if q.fixed:
            continue
        lang, perms, prompts = render_question(request.state_text, q, tokenizer.bos)
        rendered.append((q, lang, perms, prompts))
        texts.extend(prompts)
    ids: list[list[int]] = []
    if rendered and len(request.state_text) > max_positions:
        # a long state is in every prompt: measure the first question's two prompts alone before the rest
        ids = tokenizer.encode_batch(rendered[0][3])
        _check_context(rendered[0][0], ids, max_positions, request.model)
    if len(texts) > len(ids):
        ids += tokenizer.encode_batch(texts[len(ids):])
    plans = []
    for n, (q, lang, perms, prompts) in enumerate(rendered):
        token_ids = ids[2 * n: 2 * n + len(prompts)]
        _check_context(q, token_ids, max_positions, request.model)
        plans.append(QuestionPlan(q, lang, perms, prompts, token_ids, tokenizer.letter_ids[: len(q.keys)]))
    plan = RequestPlan(request, plans, sum(len(t) for t in ids), 0)
    plan.packed_tokens = packed_size(plan.prompt_specs(), prefixes or {})
    plan.planning_s = time.perf_counter() - started
    return plan


def _check_context(q: Question, token_ids: list[list[int]], max_positions: int, model: str) -> None:
    longest = max(len(t) for t in token_ids)
    if longest > max_positions:
        raise ContextTooLong(q.qid, longest, max_positions, model)


def check_size_cheaply(request: DecisionRequest, tokenizer: BasalTokenizer, max_positions: int) -> None:
    """Refuse a request far over the context before rendering and tokenizing every question's prompts.

    No token stands for more than `tokenizer.max_token_chars` characters (the tokenizer has no normalizer,
    PROTOCOL.md §4.6), so a prompt of C characters has at least C / that many tokens.
    """
    per_token = tokenizer.max_token_chars
    state = len(request.state_text)
    for q in request.questions:
        if q.fixed:
            continue
        chars = state + len(q.instructions_text) + sum(len(t) for t in q.options)
        if chars > max_positions * per_token:
            raise ContextTooLong(q.qid, chars // per_token, max_positions, request.model, at_least=True)


def packed_size(specs: Sequence[PromptSpec], prefixes: dict[str, Sequence[int]]) -> int:
    """Tokens the prefix tries of these prompts hold (each language row, cached template excluded)."""
    return TrieSizer(prefixes).add(specs)


def finish(plan: RequestPlan, logits: Sequence[Sequence[np.ndarray]], calibration: Calibration,
           latency_ms: float) -> dict[str, Any]:
    """The response body from the letter logits of each question's orders."""
    request = plan.request
    by_qid = {qp.question.qid: (qp, logits[n]) for n, qp in enumerate(plan.questions)}
    answers = {}
    for q in request.questions:
        if q.fixed:
            p_cal = [1.0]
        else:
            qp, order_logits = by_qid[q.qid]
            p = average_orders([np.asarray(x, dtype=np.float64).tolist() for x in order_logits], qp.perms)
            p_cal = calibrate(p, calibration.temperature(q.calibration_key))
        answers[q.qid] = answer(q, p_cal, request.dialect)
    return {"model": request.model, "answers": answers,
            "usage": usage(plan.input_tokens, request.questions, latency_ms, request.dialect)}

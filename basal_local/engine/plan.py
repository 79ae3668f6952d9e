"""Planning (on arrival): render, tokenize and size a validated request; turn letter logits into answers.

A plan is a list of readout units (QuestionPlan): one per ordinary question, one per `multi` label
(branch), one per group of a large choice (round 1) or its finalists (round 2). The engine only sees
units and their prompts; `finish` folds the units back into one Outcome per request (no dialect). A request
with a large choice takes two rounds: `finish` of round 1 returns None and `next_round` plans round 2 from the
round-1 answers (`requests.run_request` queues it like any plan).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..model.directory import Calibration
from ..model.tokenizer import BasalTokenizer, common_prefix_len
from ..protocol.act import ActError, act_answer
from ..protocol.decision import argmax_first, average_orders, calibrate
from ..protocol.errors import AnswerRefused, ContextTooLong
from ..protocol.large_choice import finalists, fit_joint, groups
from ..protocol.multi import branch_options, branch_question, multi_answer
from ..protocol.outcome import Outcome, QuestionOutcome
from ..protocol.questions import DecisionRequest, Question, detect_language
from ..protocol.render import kept_head, orders, prompt_tail, question_tails
from ..protocol.tools import tool_answer
from .packer import PromptSpec, SharedHead, TrieSizer

UnitKey = tuple[str, str, int]  # (question id, role, index)


@dataclass
class QuestionPlan:
    """One readout unit: a question (or a branch/group of one) in one or two option orders. Each order's prompt
    is `head` (template + state, one string per language of a request) and its tail."""

    question: Question
    lang: str
    perms: list[list[int]]
    head: str
    tails: list[str]
    token_ids: list[list[int]]
    letter_ids: list[int]
    role: str = "main"  # main | branch (multi label) | group (large choice, round 1) | final (round 2)
    index: int = 0
    members: list[int] | None = None  # option indices a large-choice unit asks, original order

    @property
    def key(self) -> UnitKey:
        return (self.question.qid, self.role, self.index)

    @property
    def prompts(self) -> list[str]:
        """Each order's whole prompt, built when asked (the evidence forward, `basal-local prompts`)."""
        return [self.head + tail for tail in self.tails]


@dataclass
class RequestPlan:
    request: DecisionRequest
    questions: list[QuestionPlan]  # the readout units of this round
    input_tokens: int  # every prompt of every round so far
    packed_tokens: int  # tokens a forward computes for this request alone (cached template excluded)
    arrival: float = field(default_factory=time.perf_counter)
    planning_s: float = 0.0
    round: int = 1
    carried: dict[UnitKey, list[float]] = field(default_factory=dict)  # unit probabilities of earlier rounds
    evidence: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    error: AnswerRefused | None = None  # set by finish when an answer refuses (act max_error without defer)
    context: tuple[BasalTokenizer, int, Any] | None = None  # tokenizer, positions, the prefixes' view
    background: bool = False  # batch work: computed only when no interactive request waits (scheduler)
    shared_tokens: int = 0  # leading ids every prompt of this round shares, as tokenized once (encode_shared)

    # the prompts, built once: each spec keeps what the state cache answered for it (PromptSpec.memo), so the
    # plan's size, the engine's round cost and the packer look a long document up once between them
    _specs: list[PromptSpec] | None = field(default=None, init=False, repr=False, compare=False)
    # what `packed_tokens` was sized against: (the prefixes' view, its generation) (`size_against`)
    _sized: tuple[Any, int] | None = field(default=None, init=False, repr=False, compare=False)

    def prompt_specs(self) -> list[PromptSpec]:
        if self._specs is None:
            first = self.questions[0].token_ids[0] if self.questions else []
            head = SharedHead(first, self.shared_tokens) if self.shared_tokens else None
            self._specs = [PromptSpec(ids, qp.lang, qp.letter_ids, head=head)
                           for qp in self.questions for ids in qp.token_ids]
        return self._specs

    def size_against(self, prefixes: Any) -> int:
        """Tokens a round computes against `prefixes` (packed_size of the prompts): `packed_tokens` again while the
        state cache is the one it was sized against and unchanged since (its generation)."""
        generation = getattr(prefixes, "generation", None)
        if generation is not None and self._sized is not None and self._sized[0] is prefixes \
                and self._sized[1] == generation:
            return self.packed_tokens
        return packed_size(self.prompt_specs(), prefixes)

    def __getstate__(self) -> dict[str, Any]:
        """Pickled without the specs: their memo refers to this process's state cache."""
        return {**self.__dict__, "_specs": None, "_sized": None}


class _Prompts:
    """A request's prompts as each language's head (template + state, built once: render.kept_head) and the tail
    of each prompt after it: a long document is in one string per language, not in every prompt."""

    def __init__(self, state: str, bos: str) -> None:
        self.state, self.bos = state, bos
        self.heads: dict[str, str] = {}

    def tail(self, lang: str, question_text: str, texts: Sequence[str], perm: Sequence[int]) -> str:
        kept_head(self.heads, self.state, lang, self.bos)
        return prompt_tail(question_text, texts, perm, lang)

    def question(self, q: Question) -> tuple[str, list[list[int]], list[str]]:
        lang, perms, tails = question_tails(self.state, q)
        kept_head(self.heads, self.state, lang, self.bos)
        return lang, perms, tails


# a readout unit before tokenizing: (question, lang, perms, tails, role, index, members)
Unit = tuple[Question, str, list[list[int]], list[str], str, int, list[int] | None]


def _render_units(request: DecisionRequest, render: _Prompts) -> list[Unit]:
    """(question, lang, perms, tails, role, index, members) of every round-1 unit."""
    state = request.state_text
    units: list[Unit] = []
    for q in request.questions:
        if q.fixed:
            continue
        if q.qtype == "multi":
            lang = detect_language(state, q.instructions_text)
            texts = list(branch_options(lang))
            perms = orders(2)
            for i, label in enumerate(q.options):
                text = branch_question(lang, q.instructions_text, label)
                tails = [render.tail(lang, text, texts, p) for p in perms]
                units.append((q, lang, perms, tails, "branch", i, None))
        elif q.large:
            lang = detect_language(state, q.instructions_text)
            for g, members in enumerate(groups(len(q.keys))):
                # a group shows the options as the whole question would (option_keys "hide" looks for
                # duplicate texts among all options, not only the group's)
                texts = [q.options[i] for i in members]
                perm = list(range(len(members)))
                units.append((q, lang, [perm], [render.tail(lang, q.instructions_text, texts, perm)], "group", g,
                              members))
        else:
            lang, perms, tails = render.question(q)
            units.append((q, lang, perms, tails, "main", 0, None))
    return units


def _tokenize_units(request: DecisionRequest, units: list[Unit], render: _Prompts, tokenizer: BasalTokenizer,
                    max_positions: int) -> tuple[list[QuestionPlan], int, int]:
    """The units' plans, their tokens in all, and how many leading ids every prompt shares (`encode_shared`)."""
    heads = render.heads
    ids: list[list[int]] = []
    # where the state ends in the prompts (its language's head ends with it): the tokenizer keeps the ids of
    # template + state of a long document
    state = request.state_text
    remember = len(heads[units[0][1]]) if units and len(state) >= 1024 else 0
    shared = 0
    if len(heads) == 1 and tokenizer.splits:  # one head before every tail: a known document's is not copied
        ids, shared = tokenizer.encode_after(next(iter(heads.values())), [t for u in units for t in u[3]], remember)
    else:
        texts = [heads[u[1]] + t for u in units for t in u[3]]
        chars = len(next(iter(heads.values()))) if len(heads) == 1 else 0
        if units and len(state) > max_positions and not tokenizer.splits:
            # a long state is in every prompt: measure the first unit's prompts alone before the rest (a tokenizer
            # that splits tokenizes the state once for all of them anyway)
            ids, shared = tokenizer.encode_shared(texts[:len(units[0][3])], remember, chars)
            _check_context(units[0][0], ids, max_positions, request.model)
        if len(texts) > len(ids):
            rest, more = tokenizer.encode_shared(texts[len(ids):], remember, chars)
            if ids:  # what the two calls share: at most what each shares within itself
                more = min(shared, more)
                shared = common_prefix_len(rest[0][:more], ids[0][:more])
            else:
                shared = more
            ids += rest
    plans, at = [], 0
    for q, lang, perms, tails, role, index, members in units:
        token_ids = ids[at: at + len(tails)]
        at += len(tails)
        _check_context(q, token_ids, max_positions, request.model)
        plans.append(QuestionPlan(q, lang, perms, heads[lang], tails, token_ids,
                                  tokenizer.letter_ids[: len(perms[0])], role, index, members))
    return plans, sum(len(t) for t in ids), shared


def plan_request(request: DecisionRequest, tokenizer: BasalTokenizer, max_positions: int,
                 prefixes: Any = None) -> RequestPlan:
    """Render and tokenize every round-1 unit; raises ContextTooLong for too-long prompts."""
    started = time.perf_counter()
    check_size_cheaply(request, tokenizer, max_positions)
    render = _Prompts(request.state_text, tokenizer.bos)
    plans, tokens, shared = _tokenize_units(request, _render_units(request, render), render, tokenizer,
                                            max_positions)
    plan = RequestPlan(request, plans, tokens, 0, context=(tokenizer, max_positions, prefixes or {}),
                       shared_tokens=shared)
    _size(plan, prefixes or {})
    plan.arrival = time.perf_counter()  # queued from here (the server sets the request's own arrival instead)
    plan.planning_s = plan.arrival - started
    return plan


def _size(plan: RequestPlan, prefixes: Any) -> None:
    generation = getattr(prefixes, "generation", None)  # read first: a change while sizing makes it stale
    plan.packed_tokens = packed_size(plan.prompt_specs(), prefixes)
    if generation is not None:
        plan._sized = (prefixes, generation)


def _check_context(q: Question, token_ids: list[list[int]], max_positions: int, model: str) -> None:
    longest = max(len(t) for t in token_ids)
    if longest > max_positions:
        raise ContextTooLong(q.qid, longest, max_positions, model)


def check_size_cheaply(request: DecisionRequest, tokenizer: BasalTokenizer, max_positions: int) -> None:
    """Refuse a request far over the context before rendering and tokenizing every question's prompts.

    No token stands for more than `tokenizer.max_token_chars` characters (the tokenizer has no normalizer,
    docs/PROTOCOL.md §4.6), so a prompt of C characters has at least C / that many tokens.
    """
    per_token = tokenizer.max_token_chars
    state = len(request.state_text)
    for q in request.questions:
        if q.fixed:
            continue
        # every prompt holds all options, except multi branches (one label) and large-choice groups (some)
        options = 0 if q.qtype == "multi" or q.large else sum(len(t) for t in q.options)
        chars = state + len(q.instructions_text) + options
        if chars > max_positions * per_token:
            raise ContextTooLong(q.qid, chars // per_token, max_positions, request.model, at_least=True)


def packed_size(specs: Sequence[PromptSpec], prefixes: Any) -> int:
    """Tokens the prefix tries of these prompts hold (each row, what it continues from the cache excluded);
    `prefixes`: templates by language, or the state cache (packer.prefix_view)."""
    return TrieSizer(prefixes).add(specs)


def _large_groups(q: Question, results: dict[UnitKey, list[float]]) -> tuple[list[list[int]], list[list[float]]]:
    members = groups(len(q.keys))
    return members, [results[(q.qid, "group", g)] for g in range(len(members))]


def next_round(plan: RequestPlan) -> RequestPlan | None:
    """Round 2 of the large choices (their finalists in both orders), or None when the request is complete."""
    request = plan.request
    if plan.round != 1 or not any(q.large for q in request.questions):
        return None
    if plan.context is None:
        raise RuntimeError("a large-choice plan lost its planning context (tokenizer, positions, prefixes)")
    tokenizer, max_positions, prefixes = plan.context
    started = time.perf_counter()
    render = _Prompts(request.state_text, tokenizer.bos)
    units: list[Unit] = []
    for q in request.questions:
        if not q.large:
            continue
        members, targets = _large_groups(q, plan.carried)
        chosen = finalists(fit_joint(len(q.keys), members, targets))
        lang = detect_language(request.state_text, q.instructions_text)
        texts = [q.options[i] for i in chosen]
        perms = orders(len(chosen))
        tails = [render.tail(lang, q.instructions_text, texts, p) for p in perms]
        units.append((q, lang, perms, tails, "final", 0, chosen))
    plans, tokens, shared = _tokenize_units(request, units, render, tokenizer, max_positions)
    follow = RequestPlan(request, plans, plan.input_tokens + tokens, 0, arrival=plan.arrival, round=2,
                         carried=dict(plan.carried), evidence=plan.evidence, context=plan.context,
                         background=plan.background, shared_tokens=shared)
    _size(follow, prefixes)
    follow.planning_s = plan.planning_s + time.perf_counter() - started
    return follow


def _outcome(q: Question, p_cal: list[float] | None = None, fields: dict[str, Any] | None = None) -> QuestionOutcome:
    return QuestionOutcome(q.qtype, list(q.keys), list(p_cal or []), q.legend, q.fixed, fields)


def _answer(q: Question, results: dict[UnitKey, list[float]], calibration: Calibration, plan: RequestPlan,
            unit: QuestionPlan | None) -> QuestionOutcome:
    out = _typed_answer(q, results, calibration, plan, unit)
    if q.tool is not None:
        # a tool question is asked as a choice (or a multi) and answered from that answer; tools exist on the
        # upstream wire only, where a choice's confidence is its top probability
        base = out.fields if out.fields is not None else {
            "type": "choice", "choice": q.keys[argmax_first(out.p_cal)],
            "probabilities": dict(zip(q.keys, out.p_cal)), "confidence": max(out.p_cal)}
        out.fields = tool_answer(q.tool, base, calibration.thresholds)
    return out


def _typed_answer(q: Question, results: dict[UnitKey, list[float]], calibration: Calibration, plan: RequestPlan,
                  unit: QuestionPlan | None) -> QuestionOutcome:
    temperature = calibration.temperature(q.calibration_key)
    if q.fixed:
        return _outcome(q, [1.0])
    if q.qtype == "multi":
        probs = [calibrate(results[(q.qid, "branch", i)], temperature)[0] for i in range(len(q.keys))]
        return _outcome(q, fields=multi_answer(q.keys, probs, q.spec))
    if q.large:
        members, targets = _large_groups(q, results)
        if unit is None or unit.members is None:
            raise RuntimeError(f"large choice {q.qid!r}: the final round's answer is missing")
        p = fit_joint(len(q.keys), [*members, unit.members], [*targets, results[(q.qid, "final", 0)]])
        return _outcome(q, calibrate(p, temperature))
    p_cal = calibrate(results[(q.qid, "main", 0)], temperature)
    if q.qtype == "act":
        try:
            return _outcome(q, fields=act_answer(q.spec, q.keys, p_cal, calibration.thresholds,
                                                 bool(calibration.temperatures)))
        except ActError as exc:
            plan.error = plan.error or AnswerRefused(q.qid, exc.msg)
            return _outcome(q, fields={"type": "act"})
    return _outcome(q, p_cal)


def finish(plan: RequestPlan, logits: Sequence[Sequence[np.ndarray]], calibration: Calibration) -> Outcome | None:
    """The request's Outcome from the letter logits of each unit's orders; None when another round follows.

    A refusal (act `max_error` without a defer action) is left in `plan.error` and in `Outcome.refused`."""
    request = plan.request
    results = dict(plan.carried)
    for n, qp in enumerate(plan.questions):
        results[qp.key] = average_orders([np.asarray(x, dtype=np.float64).tolist() for x in logits[n]], qp.perms)
    plan.carried = results
    if plan.round == 1 and any(q.large for q in request.questions):
        return None
    finals = {qp.question.qid: qp for qp in plan.questions if qp.role == "final"}
    answers = {}
    for q in request.questions:
        answers[q.qid] = _answer(q, results, calibration, plan, finals.get(q.qid))
        if q.evidence:
            answers[q.qid].evidence = plan.evidence.get(q.qid, [])
    refused = None if plan.error is None else (plan.error.qid, plan.error.message)
    return Outcome(request.model, answers, plan.input_tokens, plan.packed_tokens, plan.planning_s * 1000.0,
                   refused=refused)

"""Choosing a `multi` answer set by an objective and constraints, from the labels' independent probabilities.

The model gives each label i an independent probability p_i (its yes/no branch). The true set Y is then a
random set with P(i in Y) = p_i, independently, and an answer set S scores:
- `exact`: 1 if S == Y else 0, so E = P(Y == S) = prod_{i in S} p_i * prod_{i not in S} (1 - p_i);
- `iou`:   |S & Y| / |S | Y| (1 when both are empty);
- `f1`:    2 |S & Y| / (|S| + |Y|) (1 when both are empty).
We answer the S that maximizes the expected score subject to the constraints:
- `min` / `max`: bounds on |S| (negative counts as 0, as in the threshold rule);
- `exclusive`: labels that may only be selected alone (a set holding one holds nothing else);
- `fallback`: a label selected alone when the best set is empty or its `set_confidence` is below
  `fallback_threshold`; it takes part in nothing else (it is treated as exclusive and never optimized for).
`set_confidence` is always P(Y == S) of the answered set; `expected_score` its expected objective.

Why sorted prefixes suffice: with independent labels, swapping a selected label for an unselected one of higher
probability never lowers any of the three expectations, so among sets of size k drawn from one pool the best is the
k most probable. Each candidate's expectation is computed exactly from two Poisson-binomial distributions
(|S & Y| and |Y - S|), built by a dynamic programme over the sorted probabilities: O(n^2) for all prefixes and
O(n^3) in all, not 2^n. `tests/test_multi_objective.py` checks it against every subset for up to 12 labels.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

OBJECTIVES = ("threshold", "exact", "iou", "f1")


@dataclass(frozen=True)
class Constraints:
    """Count bounds (already truncated toward zero; None = not given) and the label roles."""

    min_count: int | None = None
    max_count: int | None = None
    exclusive: tuple[str, ...] = ()
    fallback: str | None = None
    fallback_threshold: float | None = None


@dataclass(frozen=True)
class Selection:
    selected: list[str]
    set_confidence: float
    expected_score: float | None
    # names of the constraints that changed the answer ("min", "max", "exclusive", "fallback")
    constraints_applied: list[str] = field(default_factory=list)


def _poisson_binomial(probabilities: Sequence[float]) -> np.ndarray:
    """PMF of the number of successes of independent Bernoulli trials."""
    pmf = np.ones(1)
    for p in probabilities:
        pmf = np.convolve(pmf, [1.0 - p, p])
    return pmf


def exact_probability(probabilities: Sequence[float], chosen: set[int]) -> float:
    """P(Y == S): the `set_confidence` of a set."""
    value = 1.0
    for i, p in enumerate(probabilities):
        value *= p if i in chosen else 1.0 - p
    return value


def expected_score(objective: str, size: int, hits: np.ndarray, misses: np.ndarray) -> float:
    """E[score] of a set of `size` labels, from the PMF of |S & Y| (`hits`) and of |Y - S| (`misses`)."""
    if size == 0:
        return float(misses[0])  # only Y == {} scores, and it scores 1 under both set measures
    a = np.arange(hits.size)[:, None]
    b = np.arange(misses.size)[None, :]
    score = a / (size + b) if objective == "iou" else 2.0 * a / (size + a + b)
    return float(hits @ score @ misses)


def _prefix_scores(objective: str, pool_p: list[float], rest_p: list[float]) -> list[float]:
    """Expected score of every prefix (the k most probable, k = 0..len(pool)) of a pool sorted by p descending."""
    n = len(pool_p)
    outside = _poisson_binomial(rest_p)
    suffixes = [np.ones(1)] * (n + 1)
    for k in range(n - 1, -1, -1):
        suffixes[k] = np.convolve(suffixes[k + 1], [1.0 - pool_p[k], pool_p[k]])
    scores, hits = [], np.ones(1)
    for k in range(n + 1):
        if k:
            hits = np.convolve(hits, [1.0 - pool_p[k - 1], pool_p[k - 1]])
        scores.append(expected_score(objective, k, hits, np.convolve(outside, suffixes[k])))
    return scores


def _singleton_score(objective: str, probabilities: Sequence[float], i: int) -> float:
    return set_score(objective, probabilities, {i})


def _count_range(c: Constraints, pool_size: int) -> tuple[int, int]:
    low = max(c.min_count or 0, 0)
    high = pool_size if c.max_count is None else min(max(c.max_count, 0), pool_size)
    return min(low, high), high  # an unreachable minimum takes as many as the bounds allow


def _singletons_allowed(c: Constraints) -> bool:
    return max(c.min_count or 0, 0) <= 1 and (c.max_count is None or c.max_count >= 1)


def _best_by_objective(objective: str, p: Sequence[float], order: list[int], solo: set[int], never: int | None,
                       c: Constraints) -> list[int]:
    """The feasible set of the highest expected score: a prefix of the pool, or one label of `solo` alone."""
    pool = [i for i in order if i not in solo]
    rest = [p[i] for i in order if i in solo]
    scores = _prefix_scores(objective, [p[i] for i in pool], rest) if objective != "exact" else None
    low, high = _count_range(c, len(pool))
    best, best_score = pool[:low], -1.0
    for k in range(low, high + 1):
        score = scores[k] if scores is not None else exact_probability(p, set(pool[:k]))
        if score > best_score:
            best, best_score = pool[:k], score
    if _singletons_allowed(c):
        for i in order:
            if i in solo and i != never:
                score = _singleton_score(objective, p, i) if objective != "exact" else exact_probability(p, {i})
                if score > best_score:
                    best, best_score = [i], score
    return best


def _best_by_threshold(p: Sequence[float], order: list[int], solo: set[int], never: int | None, threshold: float,
                       c: Constraints) -> list[int]:
    """The threshold rule (P >= threshold, cut to max, topped up to min) with the label roles: an exclusive
    label that is the most probable of those passing is answered alone; otherwise exclusive labels are left out."""
    passing = [i for i in order if p[i] >= threshold and i != never]
    if passing and passing[0] in solo:
        return passing[:1] if _singletons_allowed(c) else []
    pool = [i for i in order if i not in solo]
    chosen = [i for i in passing if i not in solo]
    if c.max_count is not None:
        chosen = chosen[: max(c.max_count, 0)]
    if c.min_count is not None and len(chosen) < c.min_count:
        chosen = pool[: c.min_count]
    return chosen


def choose(keys: Sequence[str], probabilities: Sequence[float], objective: str, constraints: Constraints,
           threshold: float = 0.5) -> Selection:
    """The answer set of a multi question (selected keys in descending-P order)."""
    if objective not in OBJECTIVES:
        raise ValueError(f"unknown objective {objective!r}")
    c = constraints
    fallback = list(keys).index(c.fallback) if c.fallback is not None else None
    order = sorted(range(len(keys)), key=lambda i: -probabilities[i])  # stable: ties keep criteria order
    exclusive = {list(keys).index(k) for k in c.exclusive}
    solo = exclusive | ({fallback} if fallback is not None else set())

    def pick(bounds: Constraints, roles: set[int]) -> list[int]:
        if objective == "threshold":
            return _best_by_threshold(probabilities, order, roles, fallback, threshold, bounds)
        return _best_by_objective(objective, probabilities, order, roles, fallback, bounds)

    chosen = pick(c, solo)
    applied = []
    if (c.min_count is not None or c.max_count is not None) and pick(Constraints(), solo) != chosen:
        applied += [name for name, v in (("min", c.min_count), ("max", c.max_count)) if v is not None]
    if exclusive and pick(c, solo - exclusive) != chosen:
        applied.append("exclusive")
    confidence = exact_probability(probabilities, set(chosen))
    if fallback is not None and (not chosen or (c.fallback_threshold is not None and confidence < c.fallback_threshold)):
        chosen = [fallback]
        confidence = exact_probability(probabilities, set(chosen))
        applied.append("fallback")
    score = None
    if objective == "exact":
        score = confidence
    elif objective != "threshold":
        score = set_score(objective, probabilities, set(chosen))
    return Selection([keys[i] for i in chosen], confidence, score, applied)


def set_score(objective: str, probabilities: Sequence[float], chosen: set[int]) -> float:
    """E[score] of one given set."""
    if objective == "exact":
        return exact_probability(probabilities, chosen)
    hits = _poisson_binomial([p for i, p in enumerate(probabilities) if i in chosen])
    misses = _poisson_binomial([p for i, p in enumerate(probabilities) if i not in chosen])
    return expected_score(objective, len(chosen), hits, misses)

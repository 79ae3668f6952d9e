"""Decision math of docs/PROTOCOL.md §5, host side, in float64 with libm (`math`) for exact digits."""

from __future__ import annotations

import math
from collections.abc import Sequence

PROB_FLOOR = 1e-12


def softmax(values: Sequence[float]) -> list[float]:
    top = max(values)
    exps = [math.exp(v - top) for v in values]
    total = sum(exps)
    return [e / total for e in exps]


def average_orders(order_logits: Sequence[Sequence[float]], perms: Sequence[Sequence[int]]) -> list[float]:
    """Per-order softmax over the letters, un-permute to criteria order, average probabilities."""
    n = len(perms[0])
    acc = [0.0] * n
    for logits, perm in zip(order_logits, perms):
        q = softmax([float(v) for v in logits])
        for position, option in enumerate(perm):
            acc[option] += q[position]
    return [a / len(perms) for a in acc]


def calibrate(p: Sequence[float], temperature: float) -> list[float]:
    """softmax(ln(max(p, 1e-12)) / T); skipped when T is exactly 1."""
    if temperature == 1.0:
        return list(p)
    return softmax([math.log(max(v, PROB_FLOOR)) / temperature for v in p])


def argmax_first(p: Sequence[float]) -> int:
    best = 0
    for i, v in enumerate(p):
        if v > p[best]:
            best = i
    return best


def choice_confidence(p: Sequence[float]) -> float:
    """TypeSafe: (max p - 1/n) / (1 - 1/n); 1.0 for a single option."""
    n = len(p)
    if n == 1:
        return 1.0
    return (max(p) - 1.0 / n) / (1.0 - 1.0 / n)


def score_value(p: Sequence[float]) -> float:
    return sum(i * v for i, v in enumerate(p))


def score_confidence(p: Sequence[float]) -> float:
    """TypeSafe: 1 - E|i - mode| / mean absolute deviation of the uniform distribution, floored at 0."""
    n = len(p)
    if n == 1:
        return 1.0
    mode = argmax_first(p)
    centre = (n - 1) / 2
    uniform_mad = sum(abs(i - centre) for i in range(n)) / n
    spread = sum(v * abs(i - mode) for i, v in enumerate(p))
    return max(0.0, 1.0 - spread / uniform_mad)

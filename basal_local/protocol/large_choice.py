"""choice with 11-255 options: the grouped `luce2-1o` strategy (docs/PROTOCOL.md §6.7).

Round 1 asks 2g groups of at most 10 options (blocks and round-robin, every option in two groups) in one
order each; a joint Luce (Plackett-Luce of one pick) fit of their probabilities picks 10 finalists; round 2
asks the finalists in both orders; the answer is the joint fit over all groups, calibrated like choice.
All math in float64 with NumPy; the Newton steps follow the spec step by step.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from .constants import MAX_OPTIONS

PROB_FLOOR = 1e-12
LOG_FLOOR = 1e-300
MAX_ITERATIONS = 100
GRAD_TOL = 1e-10
RIDGE = 1e-9


def groups(n: int) -> list[list[int]]:
    """Partition A (g contiguous blocks, the first n % g one larger) then partition B (round-robin)."""
    g = math.ceil(n / MAX_OPTIONS)
    blocks, start = [], 0
    for k in range(g):
        size = n // g + (1 if k < n % g else 0)
        blocks.append(list(range(start, start + size)))
        start += size
    robin = [list(range(k, n, g)) for k in range(g)]
    return blocks + robin


def finalists(p_joint: Sequence[float], count: int = MAX_OPTIONS) -> list[int]:
    """The `count` options of largest joint p (ties -> lower index), back in original order."""
    order = sorted(range(len(p_joint)), key=lambda i: (-p_joint[i], i))
    return sorted(order[:count])


def _softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max())
    return e / e.sum()


def _objective(theta: np.ndarray, members: list[np.ndarray], targets: list[np.ndarray]) -> float:
    total = 0.0
    for idx, t in zip(members, targets):
        s = _softmax(theta[idx])
        total += float(np.sum(t * np.log(np.maximum(s, LOG_FLOOR))))
    return total


def fit_joint(n: int, group_members: Sequence[Sequence[int]], group_targets: Sequence[Sequence[float]]) -> list[float]:
    """Luce MLE of one strength per option from per-group target distributions; returns softmax(theta)."""
    members = [np.asarray(m, dtype=np.int64) for m in group_members]
    targets = [np.asarray(t, dtype=np.float64) for t in group_targets]
    sums = np.zeros(n)
    counts = np.zeros(n)
    for idx, t in zip(members, targets):
        np.add.at(sums, idx, np.log(np.maximum(t, PROB_FLOOR)))
        np.add.at(counts, idx, 1.0)
    theta = np.where(counts > 0, sums / np.maximum(counts, 1.0), 0.0)
    value = _objective(theta, members, targets)
    for _ in range(MAX_ITERATIONS):
        grad = np.zeros(n)
        hess = np.zeros((n, n))
        for idx, t in zip(members, targets):
            s = _softmax(theta[idx])
            np.add.at(grad, idx, t - s)
            hess[np.ix_(idx, idx)] += np.diag(s) - np.outer(s, s)
        if np.max(np.abs(grad)) < GRAD_TOL:
            break
        hess += RIDGE * np.eye(n)
        try:
            chol = np.linalg.cholesky(hess)
            step = np.linalg.solve(chol.T, np.linalg.solve(chol, grad))
        except np.linalg.LinAlgError:
            step = grad
        size = 1.0
        while True:
            candidate = theta + size * step
            new_value = _objective(candidate, members, targets)
            if new_value >= value - 1e-12 or size < 1e-6:
                break
            size /= 2.0
        theta, value = candidate, new_value
    return _softmax(theta).tolist()

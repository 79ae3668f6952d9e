"""The multi objectives against brute force: every subset scored by its definition over every possible true set."""

from __future__ import annotations

import itertools
import random

import numpy as np
import pytest

from basal_local.protocol.multi import MultiSpec, select
from basal_local.protocol.multi_objective import Constraints, choose, set_score


def _truths(p: list[float]) -> tuple[np.ndarray, np.ndarray]:
    """Every true set Y as a 0/1 row, and its probability under independent labels."""
    ys = np.array(list(itertools.product((0, 1), repeat=len(p))), dtype=float)
    pr = np.prod(np.where(ys == 1, p, 1.0 - np.array(p)), axis=1)
    return ys, pr


def _by_definition(objective: str, s: np.ndarray, ys: np.ndarray, pr: np.ndarray) -> float:
    inter = ys @ s
    size_y = ys.sum(axis=1)
    size_s = s.sum()
    if objective == "exact":
        score = np.all(ys == s, axis=1).astype(float)
    elif objective == "iou":
        union = size_s + size_y - inter
        score = np.where(union == 0, 1.0, inter / np.maximum(union, 1))
    else:
        total = size_s + size_y
        score = np.where(total == 0, 1.0, 2 * inter / np.maximum(total, 1))
    return float(pr @ score)


def _brute_best(objective, p, c: Constraints, keys) -> float:
    ys, pr = _truths(p)
    exclusive = {keys.index(k) for k in c.exclusive}
    low = max(c.min_count or 0, 0)
    high = len(p) if c.max_count is None else max(c.max_count, 0)
    best = -1.0
    for bits in itertools.product((0, 1), repeat=len(p)):
        chosen = {i for i, b in enumerate(bits) if b}
        if not low <= len(chosen) <= high or (chosen & exclusive and len(chosen) > 1):
            continue
        best = max(best, _by_definition(objective, np.array(bits, dtype=float), ys, pr))
    return best


def _random_case(rng: random.Random, n: int):
    keys = [f"l{i}" for i in range(n)]
    p = [rng.choice([rng.random(), rng.random() ** 4, 1 - rng.random() ** 4, 0.5]) for _ in range(n)]
    exclusive = tuple(rng.sample(keys, min(n, rng.choice([0, 0, 1, 2]))))
    pool = n - len(exclusive)
    low = rng.choice([None, None, 0, 1, 2])
    high = rng.choice([None, None, 1, 2, 3, n])
    if low is not None and (low > pool or (high is not None and low > high)):
        low = None
    return keys, p, Constraints(min_count=low, max_count=high, exclusive=exclusive)


@pytest.mark.parametrize("objective", ["exact", "iou", "f1"])
def test_objectives_equal_brute_force_over_every_subset(objective):
    rng = random.Random(sum(map(ord, objective)))
    for trial in range(60):
        n = 12 if trial < 3 else rng.randint(1, 8)
        keys, p, c = _random_case(rng, n)
        picked = choose(keys, p, objective, c)
        best = _brute_best(objective, p, c, keys)
        ys, pr = _truths(p)
        s = np.array([1.0 if k in picked.selected else 0.0 for k in keys])
        assert _by_definition(objective, s, ys, pr) == pytest.approx(best, abs=1e-12), (keys, p, c, picked)
        assert picked.expected_score == pytest.approx(best, abs=1e-12)
        assert picked.set_confidence == pytest.approx(_by_definition("exact", s, ys, pr), abs=1e-15)
        chosen = set(picked.selected)
        assert not (chosen & set(c.exclusive)) or len(chosen) == 1


def test_set_score_is_the_definition():
    rng = random.Random(5)
    for _ in range(40):
        n = rng.randint(1, 7)
        p = [rng.random() for _ in range(n)]
        chosen = {i for i in range(n) if rng.random() < 0.5}
        ys, pr = _truths(p)
        s = np.array([1.0 if i in chosen else 0.0 for i in range(n)])
        for objective in ("exact", "iou", "f1"):
            assert set_score(objective, p, chosen) == pytest.approx(_by_definition(objective, s, ys, pr), abs=1e-12)


def test_threshold_without_roles_is_the_plain_rule():
    rng = random.Random(9)
    for _ in range(200):
        n = rng.randint(1, 9)
        keys = [f"k{i}" for i in range(n)]
        p = [round(rng.random(), 2) for _ in range(n)]
        spec = MultiSpec(threshold=rng.choice([0.3, 0.5, 0.7]), max_count=rng.choice([None, 0, 1, 3]),
                         min_count=rng.choice([None, 0, 1, 2]))
        expected, confidence = select(keys, p, spec)
        got = choose(keys, p, "threshold", Constraints(spec.min_count, spec.max_count), spec.threshold)
        assert got.selected == expected and got.set_confidence == pytest.approx(confidence)
        assert got.expected_score is None


def test_exclusive_label_is_answered_alone_or_not_at_all():
    keys = ["cat", "dog", "none"]
    # threshold: "none" passes and is the most probable: alone; "cat" also passes but is dropped
    got = choose(keys, [0.6, 0.2, 0.9], "threshold", Constraints(exclusive=("none",)))
    assert got.selected == ["none"] and got.constraints_applied == ["exclusive"]
    # "cat" is the most probable: "none" is left out although it passes the threshold
    got = choose(keys, [0.95, 0.2, 0.6], "threshold", Constraints(exclusive=("none",)))
    assert got.selected == ["cat"] and "exclusive" in got.constraints_applied
    got = choose(keys, [0.95, 0.9, 0.6], "f1", Constraints(exclusive=("none",)))
    assert got.selected == ["cat", "dog"]


def test_fallback_when_nothing_is_selected_or_confidence_is_low():
    keys = ["fraud", "spam", "other"]
    got = choose(keys, [0.1, 0.2, 0.3], "threshold", Constraints(fallback="other"))
    assert got.selected == ["other"] and got.constraints_applied == ["fallback"]
    assert got.set_confidence == pytest.approx(0.9 * 0.8 * 0.3)
    # the fallback is never optimized for: with it most probable, a set without it is still chosen first
    got = choose(keys, [0.9, 0.2, 0.95], "exact", Constraints(fallback="other"))
    assert got.selected == ["fraud"] and got.constraints_applied == []
    got = choose(keys, [0.9, 0.2, 0.95], "exact", Constraints(fallback="other", fallback_threshold=0.5))
    assert got.selected == ["other"] and got.constraints_applied == ["fallback"]
    assert got.expected_score == pytest.approx(0.1 * 0.8 * 0.95)


def test_count_bounds_are_reported_when_they_change_the_answer():
    keys = ["a", "b", "c", "d"]
    p = [0.9, 0.8, 0.7, 0.1]
    assert choose(keys, p, "exact", Constraints()).selected == ["a", "b", "c"]
    got = choose(keys, p, "exact", Constraints(max_count=1))
    assert got.selected == ["a"] and got.constraints_applied == ["max"]
    got = choose(keys, p, "f1", Constraints(min_count=4))
    assert got.selected == ["a", "b", "c", "d"] and got.constraints_applied == ["min"]
    assert choose(keys, p, "iou", Constraints(max_count=10)).constraints_applied == []


def test_many_labels_stay_fast_and_exact_at_the_optimum():
    rng = random.Random(1)
    p = [rng.random() for _ in range(255)]
    keys = [f"x{i}" for i in range(255)]
    got = choose(keys, p, "f1", Constraints())
    order = sorted(range(255), key=lambda i: -p[i])
    k = len(got.selected)
    assert got.selected == [keys[i] for i in order[:k]]
    for other in (k - 1, k + 1):  # neighbours of the optimum score no better
        assert set_score("f1", p, set(order[:other])) <= got.expected_score + 1e-12

"""basal-1.5 extensions without a model: multi selection (§6.4), act (§6.5), the Luce fit (§6.7)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from basal_local.protocol.act import NEEDS_DEFER, ActError, ActSpec, act_answer, act_base, parse_costs
from basal_local.protocol.large_choice import finalists, fit_joint, groups
from basal_local.protocol.multi import MultiSpec, select

from .reference import luce_fit

THRESHOLDS = {"0.01": 0.955, "0.05": 0.763}


# ---- multi ------------------------------------------------------------------------------------------------
def test_multi_golden_vector():
    """§9: P(a)=0.479…, P(b)=0.171…, threshold 0.5 -> nothing selected, set confidence 0.4312462774264451."""
    selected, conf = select(["a", "b"], [0.4792832104562643, 0.17182183081841235], MultiSpec(0.5))
    assert selected == [] and conf == 0.4312462774264451


@pytest.mark.parametrize("p, spec, expected", [
    ([0.2, 0.9, 0.6], MultiSpec(0.5), ["b", "c"]),  # descending P order
    ([0.7, 0.7, 0.1], MultiSpec(0.5), ["a", "b"]),  # ties keep criteria order
    ([0.7, 0.8, 0.7], MultiSpec(0.5, max_count=2), ["b", "a"]),  # tie at the cut: the earlier label
    ([0.9, 0.8], MultiSpec(0.5, max_count=0), []),
    ([0.9, 0.8], MultiSpec(0.5, max_count=-3), []),  # negative max counts as 0
    ([0.1, 0.3, 0.2], MultiSpec(0.5, min_count=2), ["b", "c"]),
    ([0.1, 0.3, 0.2], MultiSpec(0.5, min_count=7), ["b", "c", "a"]),  # min above the count: everything
    ([0.1, 0.3], MultiSpec(0.5, min_count=-1), []),
    ([0.9, 0.8, 0.7], MultiSpec(0.5, max_count=1, min_count=2), ["a", "b"]),  # min applied after max
    ([0.5, 0.4999999], MultiSpec(0.5), ["a"]),  # P >= threshold
])
def test_multi_selection_rule(p, spec, expected):
    keys = ["a", "b", "c"][: len(p)]
    selected, conf = select(keys, p, spec)
    assert selected == expected
    want = 1.0
    for k, v in zip(keys, p):
        want *= v if k in expected else 1.0 - v
    assert conf == want


# ---- act --------------------------------------------------------------------------------------------------
def test_act_worked_check_full_form():
    """§6.5: P(true)=0.962, approve {0, 1240}, reject {300, 0}, human {15, 15} -> approve 47.12, action human."""
    costs = {"approve": {"true": 0, "false": 1240}, "reject": {"true": 300, "false": 0}, "human": {"true": 15,
                                                                                                    "false": 15}}
    actions, rows, defer = parse_costs(costs, ["true", "false"], None)
    assert actions == ["approve", "reject", "human"] and defer == "human"
    spec = ActSpec("noul", tuple(actions), tuple(map(tuple, rows)), defer)
    out = act_answer(spec, ["true", "false"], [0.962, 1 - 0.962], THRESHOLDS, True)
    assert out["expected_costs"] == {"approve": 47.12, "reject": 288.6, "human": 15.0}
    assert out["action"] == "human" and out["answer"] == "true" and out["confidence"] == 0.962
    assert out["calibration"] == "validated" and list(out) == [
        "type", "action", "expected_costs", "answer", "probabilities", "confidence", "calibration"]


def test_act_worked_check_short_form():
    """§6.5: uniform p, wrong 99, defer 1 -> a: 49.5, action defer."""
    actions, rows, defer = parse_costs({"wrong": 99, "defer": 1}, ["a", "b"], None)
    assert actions == ["a", "b", "defer"] and rows == [[0, 99], [99, 0], [1, 1]] and defer == "defer"
    spec = ActSpec("choice", tuple(actions), tuple(map(tuple, rows)), defer)
    out = act_answer(spec, ["a", "b"], [0.5, 0.5], THRESHOLDS, True)
    assert out["expected_costs"] == {"a": 49.5, "b": 49.5, "defer": 1.0} and out["action"] == "defer"
    assert out["calibration"] == "unvalidated"  # choice base with option keys shown


def test_act_rounding_and_ties():
    spec = ActSpec("noul", ("x", "y"), ((1 / 3, 0.0), (0.0, 1 / 3)), None)
    out = act_answer(spec, ["true", "false"], [0.5, 0.5], {}, True)
    assert out["expected_costs"] == {"x": 0.166667, "y": 0.166667} and out["action"] == "x"  # first on ties


def test_act_max_error():
    spec = ActSpec("noul", ("approve", "reject", "defer"), ((0.0, 10.0), (10.0, 0.0), (1.0, 1.0)), "defer",
                   max_error=0.05)
    low = act_answer(spec, ["true", "false"], [0.7, 0.3], THRESHOLDS, True)
    # E: approve 3, reject 7, defer 1 -> defer anyway, nothing refused
    assert low["action"] == "defer" and "refused" not in low
    spec = ActSpec("noul", ("approve", "reject", "defer"), ((0.0, 10.0), (10.0, 0.0), (5.0, 5.0)), "defer",
                   max_error=0.05)
    out = act_answer(spec, ["true", "false"], [0.75, 0.25], THRESHOLDS, True)  # approve 2.5 < 5, conf 0.75 < 0.763
    assert out["action"] == "defer" and out["refused"] == "approve" and list(out)[-2:] == ["refused", "calibration"]
    ok = act_answer(spec, ["true", "false"], [0.8, 0.2], THRESHOLDS, True)
    assert ok["action"] == "approve" and "refused" not in ok
    unknown = ActSpec("noul", ("a", "b"), ((0.0, 1.0), (1.0, 0.0)), None, max_error=0.02)
    out = act_answer(unknown, ["true", "false"], [0.6, 0.4], THRESHOLDS, True)
    assert out["max_error"] == "no certified threshold for this target"
    no_defer = ActSpec("noul", ("a", "b"), ((0.0, 1.0), (1.0, 0.0)), None, max_error=0.01)
    with pytest.raises(ActError) as err:
        act_answer(no_defer, ["true", "false"], [0.6, 0.4], THRESHOLDS, True)
    assert err.value.msg == NEEDS_DEFER


def test_act_max_error_key_is_python_str():
    spec = ActSpec("noul", ("a", "b", "human"), ((0.0, 1.0), (1.0, 0.0), (0.45, 0.45)), "human", max_error=1)
    out = act_answer(spec, ["true", "false"], [0.6, 0.4], {"1": 0.9, "1.0": 0.0}, True)
    assert out["action"] == "human" and out["refused"] == "a"  # key "1", not "1.0"


@pytest.mark.parametrize("criteria, base, expected", [
    ({"true": "x"}, None, "noul"), ({}, None, "noul"), (None, None, "noul"), ({"a": 1}, "noul", "noul"),
    ({"a": 1, "b": 2}, None, "choice"), ({"a": 1, "true": 2}, "choice", "choice"), (["a", "b"], "score", "score"),
])
def test_act_base(criteria, base, expected):
    assert act_base(criteria, base) == expected


def test_act_errors():
    with pytest.raises(ActError, match="unsupported act base 'rank'"):
        act_base({"a": 1, "b": 2}, "rank")
    with pytest.raises(ActError) as err:
        parse_costs({"approve": {"true": 0}}, ["true", "false"], None)
    assert err.value.msg == """costs["approve"] must give a cost for every outcome ['true', 'false']"""
    with pytest.raises(ActError):
        parse_costs({}, ["a", "b"], None)
    with pytest.raises(ActError) as err:
        parse_costs(None, ["a", "b"], None)
    assert err.value.kind == "missing"
    _, _, defer = parse_costs({"x": {"a": 0, "b": 1}, "y": {"a": 1, "b": 0}, "human": {"a": 1, "b": 1},
                               "defer": {"a": 2, "b": 2}}, ["a", "b"], "")
    assert defer == "defer"  # "defer" before "human"; an empty defer_action is ignored
    _, _, defer = parse_costs({"x": {"a": 0, "b": 1}, "wait": {"a": 1, "b": 1}}, ["a", "b"], "wait")
    assert defer == "wait"


# ---- large choice -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("n", [11, 12, 20, 21, 37, 100, 255])
def test_groups_partition(n):
    gs = groups(n)
    g = math.ceil(n / 10)
    assert len(gs) == 2 * g and all(2 <= len(x) <= 10 for x in gs)
    blocks, robin = gs[:g], gs[g:]
    assert [i for b in blocks for i in b] == list(range(n))
    assert [len(b) for b in blocks] == [n // g + 1] * (n % g) + [n // g] * (g - n % g)
    assert robin == [list(range(k, n, g)) for k in range(g)]


def test_groups_n11():
    assert groups(11) == [[0, 1, 2, 3, 4, 5], [6, 7, 8, 9, 10], [0, 2, 4, 6, 8, 10], [1, 3, 5, 7, 9]]


def test_finalists_ties_to_lower_index():
    p = [0.1] * 12
    p[11] = 0.2
    assert finalists(p) == [0, 1, 2, 3, 4, 5, 6, 7, 8, 11]


@pytest.mark.parametrize("n, seed", [(11, 0), (17, 1), (30, 2), (64, 3)])
def test_luce_fit_matches_an_independent_solver(n, seed):
    rng = np.random.default_rng(seed)
    gs = groups(n)
    targets = [rng.dirichlet(np.full(len(m), 0.7)) for m in gs]
    ours = np.array(fit_joint(n, gs, targets))
    ref = luce_fit(n, gs, targets)  # Hunter's MM algorithm (tests/reference.py), not Newton's method
    assert abs(ours.sum() - 1.0) < 1e-12
    assert np.max(np.abs(ours - ref)) < 1e-9


def test_luce_fit_consistent_targets_are_recovered():
    """Targets that are exact restrictions of one distribution give that distribution back."""
    rng = np.random.default_rng(7)
    n = 23
    truth = rng.dirichlet(np.ones(n))
    gs = groups(n)
    targets = [truth[m] / truth[m].sum() for m in gs]
    assert np.max(np.abs(np.array(fit_joint(n, gs, targets)) - truth)) < 1e-12

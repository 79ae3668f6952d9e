"""Decision math (docs/PROTOCOL.md §5) against the golden vectors of §9, to the last printed digit."""

from basal_local.protocol.answers import answer
from basal_local.protocol.decision import (
    average_orders,
    calibrate,
    choice_confidence,
    score_confidence,
    score_value,
)
from basal_local.protocol.questions import Question


def test_choice_golden():
    p = average_orders([[32.090171813964844, 22.251691818237305, 25.60671615600586],
                        [22.09262466430664, 20.98324966430664, 29.71462059020996]], [[0, 1, 2], [2, 1, 0]])
    assert p == [0.998885019678694, 0.00010730501585450987, 0.0010076753054513916]
    p_cal = calibrate(p, 1.2782470235604306)
    assert p_cal == [0.9947136637230513, 0.0007811711951125677, 0.004505165081836261]
    assert choice_confidence(p_cal) == 0.9920704955845767


def test_noul_golden():
    p = average_orders([[20.54022216796875, 29.693283081054688], [32.708038330078125, 22.61990737915039]],
                       [[0, 1], [1, 0]])
    assert p == [7.372613257360534e-05, 0.9999262738674264]
    assert calibrate(p, 1.7817974362806785) == [0.004772230498627664, 0.9952277695013723]


def test_score_golden():
    p = [0.07998318024813036, 0.9200168197518697]
    assert (score_value(p), score_confidence(p)) == (0.9200168197518697, 0.8400336395037393)
    p = [0.04692466242647387, 0.22873214401769956, 0.7243431935558265]
    assert (score_value(p), score_confidence(p)) == (1.6774185311293526, 0.516127796694029)


def test_temperature_one_is_skipped_exactly():
    p = [0.3, 0.7000000000000001]
    assert calibrate(p, 1.0) == p  # no log/exp round trip
    # the 1e-12 floor keeps zeros finite: softmax(ln 1e-12 / 2, ln 1 / 2) = (1e-6, 1) / (1 + 1e-6)
    low, high = calibrate([0.0, 1.0], 2.0)
    assert abs(low - 1e-6 / (1 + 1e-6)) <= 1e-18 and abs(high - 1 / (1 + 1e-6)) <= 1e-15


def test_ties_take_the_first_key():
    q = Question("q", "choice", "", ("a", "b", "c"), ("a", "b", "c"), "choice")
    assert answer(q, [0.4, 0.4, 0.2], "systemone")["choice"] == "a"
    assert answer(q, [0.2, 0.4, 0.4], "basal")["choice"] == "b"
    # identical option texts: both orders see one prompt, so p is symmetric (0.5 each for two options)
    p = average_orders([[1.0, 3.0], [1.0, 3.0]], [[0, 1], [1, 0]])
    assert p[0] == p[1] and abs(p[0] - 0.5) < 1e-15


def test_score_confidence_floor_and_single_level():
    assert score_confidence([0.5, 0.0, 0.5]) == 0.0
    assert score_confidence([1.0]) == 1.0 and choice_confidence([1.0]) == 1.0


def test_answer_shapes_per_dialect():
    noul = Question("n", "noul", "", ("true", "false"), ("", ""), "noul")
    assert answer(noul, [0.25, 0.75], "systemone") == {"type": "noul", "noul": 0.25}
    assert answer(noul, [0.25, 0.75], "basal") == {"type": "noul", "noul": 0.25,
                                                    "probabilities": {"true": 0.25, "false": 0.75},
                                                    "confidence": 0.75}
    score = Question("s", "score", "", ("0", "1"), ("lo", '{"x": 1}'), "score", legend={"0": "lo", "1": {"x": 1}})
    out = answer(score, [0.25, 0.75], "systemone")
    assert list(out) == ["type", "score", "legend", "probabilities", "confidence"]
    assert out["legend"] == {"0": "lo", "1": {"x": 1}} and out["confidence"] == 0.5

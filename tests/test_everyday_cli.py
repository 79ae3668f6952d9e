"""Everyday command-line details: what `ask` calls its numbers, shell completion for every subcommand."""

from __future__ import annotations

# ---- ask: the answer's probability is `p`; "confidence" only for TypeSafe's formula, under that name -----------

def test_ask_names_the_largest_probability_p_and_typesafes_formula_by_its_name():
    from basal_local.commands.ask import chart

    # /v1/basal: its `confidence` is the largest p, so only p is printed
    basal = {"type": "choice", "choice": "refund", "probabilities": {"refund": 0.7, "repair": 0.3},
             "confidence": 0.7}
    text = chart("What?", basal, color=False)
    assert text.splitlines()[1] == "  → refund  (p = 0.700)" and "confidence" not in text
    # /v1/systemone: (0.7 - 1/2) / (1 - 1/2) = 0.4, a different number under its own name
    typesafe = {**basal, "confidence": 0.4}
    text = chart("What?", typesafe, color=False, dialect="systemone")
    assert "  → refund  (p = 0.700)\n    TypeSafe confidence 0.400 = (p - 1/n) / (1 - 1/n)" in text
    score = {"type": "score", "score": 0.25, "legend": {"0": "low", "1": "high"},
             "probabilities": {"0": 0.75, "1": 0.25}, "confidence": 0.75}
    assert chart("How bad?", score, color=False).splitlines()[1] == "  → score 0.25  (most likely 0 low, p = 0.750)"
    noul = {"type": "noul", "noul": 0.25, "probabilities": {"true": 0.25, "false": 0.75}, "confidence": 0.75}
    text = chart("Urgent?", noul, color=False)
    assert text.splitlines()[1] == "  → no  (p(true) = 0.250)" and "confidence" not in text
